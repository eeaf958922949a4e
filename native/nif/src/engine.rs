//! The Server's engine thread: steps go in over a channel, outcomes come back as messages, so
//! the GenServer never waits for a forward pass.

use crate::context::ContextRes;
use crate::error::{guard, Out, Status};
use crate::step::{encode_outcome, StepTerm};
use llama_cpp_ex_engine::EngineThread;
use rustler::env::OwnedEnv;
use rustler::{Encoder, Env, LocalPid, ResourceArc, Term};

pub struct EngineRes {
    thread: EngineThread,
    model: std::sync::Arc<llama_cpp_ex_engine::Model>,
}

#[rustler::resource_impl]
impl rustler::Resource for EngineRes {}

#[rustler::nif]
fn engine_start<'a>(env: Env<'a>, c: ResourceArc<ContextRes>) -> Term<'a> {
    let r: Out<ResourceArc<EngineRes>> = guard(|| {
        Ok(ResourceArc::new(EngineRes {
            thread: EngineThread::start(c.ctx.clone())?,
            model: c.model.clone(),
        }))
    });
    r.encode(env)
}

/// Queues a step; its outcome arrives as `{ref, {:ok, outcome}}` or `{ref, {:error, reason}}`.
#[rustler::nif]
fn engine_submit<'a>(
    engine: ResourceArc<EngineRes>,
    pid: LocalPid,
    reference: Term<'a>,
    step: StepTerm,
) -> Status {
    Status(guard(|| {
        let owned = OwnedEnv::new();
        let saved = owned.save(reference);
        let model = engine.model.clone();
        let reply = move |result: llama_cpp_ex_engine::error::Result<_>| {
            let mut owned = owned;
            let _ = owned.send_and_clear(&pid, |env: Env| {
                let r = saved.load(env);
                match result {
                    Ok(outcome) => (
                        r,
                        (crate::atoms::ok(), encode_outcome(env, &model, &outcome)),
                    )
                        .encode(env),
                    Err(e) => {
                        (r, (crate::atoms::error(), crate::error::NifError::from(e))).encode(env)
                    }
                }
            });
        };
        engine
            .thread
            .submit(step.into_step(&engine.model)?, Box::new(reply))?;
        Ok(())
    }))
}

#[rustler::nif]
fn engine_stop(engine: ResourceArc<EngineRes>) -> rustler::Atom {
    engine.thread.stop();
    crate::atoms::ok()
}
