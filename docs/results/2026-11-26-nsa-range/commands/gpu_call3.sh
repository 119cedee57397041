set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
which compute-sanitizer || ls /usr/local/cuda*/bin 2>/dev/null | head -3
C="timeout 60 python3 scratch/var/check.py"
$C a_current 128 65536 0 fwd 2>&1 | grep RESULT
$C a_current 128 65536 0 bwd 2>&1 | grep RESULT
$C a_current 128 16384 0 bwd 2>&1 | grep RESULT
$C a_current 128 65536 1 bwd 2>&1 | grep RESULT
$C b_noacc 128 65536 0 bwd 2>&1 | grep RESULT
$C c_dq1loop 128 65536 0 bwd 2>&1 | grep RESULT
$C d_fwd1loop 128 65536 0 bwd 2>&1 | grep RESULT
$C e_noreverse 128 65536 0 bwd 2>&1 | grep RESULT
$C a_current 64 65536 0 bwd 2>&1 | grep RESULT
