"""The CPU kernels (C++, built on first use where the CPU has their instructions) and their Python side."""
