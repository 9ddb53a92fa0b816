#!/usr/bin/env python3
"""Compile every CUDA kernel source in cuda/ with NVRTC, without a GPU.

NVRTC is loaded with ctypes from the PyPI wheel nvidia-cuda-nvrtc; the CUDA headers come from the
wheel nvidia-cuda-runtime (the kernels include none, but the include path is passed so a future
kernel that does still compiles the way it will at run time). Each `.cu` file is compiled on its
own for every architecture asked for, with the options the library uses (src/backend/cuda/kernels.rs),
and to a cubin, so that the PTX assembler checks the inline PTX too.

usage: nvrtc_check.py --site DIR [--arch sm_80 --arch sm_90a] [--dir cuda]
"""

import argparse
import ctypes
import glob
import os
import sys


def find_one(patterns):
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def load_nvrtc(site):
    lib = find_one([
        os.path.join(site, "nvidia", "cu13", "lib", "libnvrtc.so.13"),
        os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*"),
        os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*"),
    ])
    if lib is None:
        sys.exit(f"libnvrtc not found under {site} (pip install nvidia-cuda-nvrtc==13.0.88 --target {site})")
    # libnvrtc opens its builtins library by name at compile time; load it first by path.
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(lib), "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
    nvrtc = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return nvrtc, lib


def include_dir(site):
    header = find_one([
        os.path.join(site, "nvidia", "cu13", "include", "cuda_fp16.h"),
        os.path.join(site, "nvidia", "*", "include", "cuda_fp16.h"),
    ])
    if header is None:
        sys.exit(f"cuda_fp16.h not found under {site} (pip install nvidia-cuda-runtime==13.0.96 --target {site})")
    return os.path.dirname(header)


def check(nvrtc, rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")


def compile_one(nvrtc, path, headers, arch, includes):
    src = open(path, "rb").read()
    names = [n.encode() for n in headers]
    bodies = [headers[n] for n in headers]
    prog = ctypes.c_void_p()
    n = len(names)
    check(nvrtc, nvrtc.nvrtcCreateProgram(
        ctypes.byref(prog), src, os.path.basename(path).encode(), n,
        (ctypes.c_char_p * n)(*bodies), (ctypes.c_char_p * n)(*names)), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo", "-DTL_NVRTC=1"]
    opts += [f"--include-path={d}" for d in includes]
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), copts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace").strip()
    cubin_size = ctypes.c_size_t(0)
    if rc == 0:
        check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(cubin_size)), "nvrtcGetCUBINSize")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log, cubin_size.value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", required=True, help="folder the two wheels were installed into")
    ap.add_argument("--arch", action="append", default=[])
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", "cuda"))
    args = ap.parse_args()
    archs = args.arch or ["sm_80", "sm_90a"]
    nvrtc, lib = load_nvrtc(args.site)
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"NVRTC {major.value}.{minor.value} from {lib}")
    includes = [include_dir(args.site)]
    headers = {os.path.basename(h): open(h, "rb").read() for h in sorted(glob.glob(os.path.join(args.dir, "*.cuh")))}
    sources = sorted(glob.glob(os.path.join(args.dir, "*.cu")))
    if not sources:
        sys.exit(f"no .cu files in {args.dir}")
    failed = 0
    for path in sources:
        for arch in archs:
            rc, log, size = compile_one(nvrtc, path, headers, arch, includes)
            status = "ok" if rc == 0 else "FAILED"
            print(f"{status:6} {os.path.basename(path):20} {arch}  cubin {size} bytes")
            if log:
                print("  " + log.replace("\n", "\n  "))
            if rc != 0 or "warning" in log.lower():
                failed += rc != 0
                if rc == 0:
                    print("  (warnings are errors here)")
                    failed += 1
    total = len(sources) * len(archs)
    print(f"{total - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
