"""The benchmark suite: bench/run_gpu.sh's sections and the modules they, tests/bench and each other call.
One-off measurements kept runnable outside the suite are in bench/experiments/ (its docstring lists them
and where their numbers are recorded); raw results are in docs/benchmarks/ (README.md indexes them)."""
