"""The GPU kernels that run while a callable runs, as CUPTI sees them through torch.profiler."""

import json
import os
import tempfile

import torch


def traced_kernels(run):
    """Calls run() under the profiler; returns its kernels as sorted (start_us, dur_us, name)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "kernel")
