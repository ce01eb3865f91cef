"""``python -m gtx.native``: two lines, the machine (CPU model, cores, vector instructions, torch's
threads) and the compiler and flags the C kernels build with here: what a test run's float32 sums
depend on."""

from gtx.native import build_flags, machine

print(f"machine: {machine()}")
print(f"C kernels: {build_flags()}")
