"""The Stage1 benchmark: python bench/run.py --help; device scripts in bench/device/."""
