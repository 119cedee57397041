set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
C="timeout 60 python3 scratch/var/check.py"
$C a_current 128 4096 1 bwd 2>&1 | grep RESULT
$C f_dkvptr 128 65536 1 bwd 2>&1 | grep RESULT
$C g_dqptr 128 65536 1 bwd 2>&1 | grep RESULT
timeout 200 compute-sanitizer --tool memcheck --print-limit 5 python3 scratch/var/check.py a_current 128 4096 1 bwd 2>&1 | grep -v "^=========     " | head -40
