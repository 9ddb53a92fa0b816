//! Decode graphs: a decode step captured once per key (loop count, greedy or sampled) and
//! replayed; and recovering a stream whose capture a panic left open.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::driver::device_error;
use super::step::CudaStep;
use super::CudaBackend;
use crate::error::Result;

pub(super) struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: a graph is used only through the CudaStep that owns it, which a session uses from one
// thread at a time (`&mut` access); the driver allows using graph handles from any thread as long
// as calls on one graph are not concurrent.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: both handles were created by this Graph and are destroyed once.
            unsafe {
                let _ = result::graph::exec_destroy(self.exec);
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

impl CudaBackend {
    pub(super) fn replay(&self, step: &mut CudaStep, key: u64) -> Result<bool> {
        let Some((_, graph)) = step.graphs.iter().find(|(k, _)| *k == key) else {
            return Ok(false);
        };
        self.gpu.bind()?;
        // SAFETY: `exec` is an instantiated graph of this context; launching it on our stream
        // orders it after the step staging copy.
        unsafe { result::graph::launch(graph.exec, self.stream.cu_stream()) }
            .map_err(|e| device_error("launching the decode graph", e))?;
        Ok(true)
    }

    pub(super) fn begin_capture(&self, step: &mut CudaStep) -> Result<bool> {
        if !self.tuning.graphs {
            return Ok(false);
        }
        self.check()?;
        self.gpu.bind()?;
        // SAFETY: begins capture on our own stream; thread-local mode, so other sessions' threads
        // may keep allocating while we capture.
        unsafe {
            result::stream::begin_capture(
                self.stream.cu_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| device_error("beginning graph capture", e))?;
        step.capturing = true;
        Ok(true)
    }

    pub(super) fn end_capture(&self, step: &mut CudaStep, key: u64) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: ends the capture begun by graph_begin on the same stream.
        let ended = unsafe { result::stream::end_capture(self.stream.cu_stream()) };
        step.capturing = false;
        let launch_error = self.check();
        let graph = ended.map_err(|e| device_error("ending graph capture", e))?;
        // SAFETY: instantiates the graph captured above; on failure the graph is destroyed here,
        // otherwise the Graph value owns both handles.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(exec) => exec,
                Err(e) => {
                    // SAFETY: `graph` came from end_capture and is destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                    return Err(device_error("instantiating the decode graph", e));
                }
            };
        let owned = Graph {
            graph,
            exec,
            ctx: self.gpu.ctx.clone(),
        };
        launch_error?;
        step.graphs.retain(|(k, _)| *k != key);
        step.graphs.push((key, owned));
        // Captured work did not run: launch it now.
        self.replay(step, key).map(|_| ())
    }

    /// End a capture that a panic left open and drop what it captured, so that the stream runs
    /// work again; launch errors recorded meanwhile describe work that never ran.
    pub(super) fn abandon_capture(&self, step: &mut CudaStep) {
        step.capturing = false;
        if self.gpu.bind().is_ok() {
            // SAFETY: ends the capture graph_begin started on our stream; the partial graph is
            // destroyed at once and never launched.
            if let Ok(graph) = unsafe { result::stream::end_capture(self.stream.cu_stream()) } {
                if !graph.is_null() {
                    // SAFETY: `graph` came from end_capture and is destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
        }
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}
