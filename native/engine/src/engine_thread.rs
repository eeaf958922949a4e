//! A thread that runs steps on one context, one after another, so whoever submits them (the
//! Server's GenServer) never waits for a forward pass.

use crate::context::{Context, Step, StepOutcome};
use crate::error::{lock, EngineError, Result};
use crossbeam_channel::{unbounded, Sender};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// How a finished step is delivered.
pub type Reply = Box<dyn FnOnce(Result<StepOutcome>) + Send>;

struct Job {
    step: Step,
    reply: Reply,
}

/// The engine thread of one context.
pub struct EngineThread {
    tx: Mutex<Option<Sender<Job>>>,
}

impl EngineThread {
    /// Starts the thread; it ends when [`EngineThread::stop`] is called or this value is
    /// dropped, after the step it is running.
    pub fn start(ctx: Arc<Mutex<Context>>) -> Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        std::thread::Builder::new()
            .name("llama_cpp_ex-engine".into())
            .spawn(move || {
                for job in rx {
                    let result = catch_unwind(AssertUnwindSafe(|| lock(&ctx).step(&job.step)))
                        .unwrap_or_else(|payload| Err(EngineError::internal(payload)));
                    (job.reply)(result);
                }
            })
            .map_err(|e| EngineError::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineThread {
            tx: Mutex::new(Some(tx)),
        })
    }

    /// Queues a step; `reply` is called with its outcome on the engine thread.
    pub fn submit(&self, step: Step, reply: Reply) -> Result<()> {
        let tx = lock(&self.tx);
        let tx = tx
            .as_ref()
            .ok_or_else(|| EngineError::Internal("the engine thread was stopped".into()))?;
        tx.send(Job { step, reply })
            .map_err(|_| EngineError::Internal("the engine thread is gone".into()))
    }

    /// Stops accepting steps; queued steps still run.
    pub fn stop(&self) {
        lock(&self.tx).take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_engine_refuses_steps() {
        let (tx, _rx) = unbounded::<Job>();
        let engine = EngineThread {
            tx: Mutex::new(Some(tx)),
        };
        engine.stop();
        let err = engine
            .submit(Step::default(), Box::new(|_| {}))
            .unwrap_err();
        assert!(err.to_string().contains("stopped"), "{err}");
    }
}
