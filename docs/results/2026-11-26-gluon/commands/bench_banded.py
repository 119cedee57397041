import os, sys, runpy
sys.path.insert(0, os.getcwd())
import nemo_ssa.ops.nsa.select as S
S.IMPORTANCE_BANDED = os.environ.get("BANDED", "1") == "1"
print("IMPORTANCE_BANDED", S.IMPORTANCE_BANDED, flush=True)
sys.argv = ["bench_nsa.py"] + sys.argv[1:]
runpy.run_path("benchmarks/bench_nsa.py", run_name="__main__")
