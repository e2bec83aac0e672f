"""CUDA sources of cupyflash (.cu/.cuh), shipped as package data and compiled at run time by NVRTC."""
