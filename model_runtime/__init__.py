"""llama-cpp-python model runtime: contexts, sequences, scheduler, restore and save points."""

from .kernels import choose as _choose_llama_cpu

# Before any module of this package can import llama_cpp, which loads llama.cpp's
# libraries once per process: the kernel set and how its threads wait are chosen now
# (kernels.py).
_choose_llama_cpu()
