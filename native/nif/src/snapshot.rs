//! KV snapshots: the entries of the Server's level-2 prompt cache (copies of cached prefixes
//! outside the KV budget) and their byte form for `Server.save_prefix/3` / `load_prefix/2`.

use crate::context::ContextRes;
use crate::error::{binary, guard, Out, Status};
use llama_cpp_ex_engine::kv::KvSnapshot;
use rustler::{Binary, Encoder, Env, ResourceArc, Term};
use std::sync::Arc;

pub struct SnapshotRes {
    pub snapshot: Arc<KvSnapshot>,
}

#[rustler::resource_impl]
impl rustler::Resource for SnapshotRes {}

/// `{ref, bytes, len}` of a snapshot.
pub fn encode_snapshot<'a>(env: Env<'a>, s: &Arc<KvSnapshot>) -> Term<'a> {
    let (bytes, len) = (s.bytes(), s.len());
    let r = ResourceArc::new(SnapshotRes {
        snapshot: s.clone(),
    });
    (r, bytes, len).encode(env)
}

/// The snapshot's self-describing byte form.
#[rustler::nif(schedule = "DirtyCpu")]
fn kv_snapshot_to_binary<'a>(env: Env<'a>, s: ResourceArc<SnapshotRes>) -> Out<Term<'a>> {
    guard(|| Ok(binary(env, &s.snapshot.to_bytes())))
}

/// `{ref, bytes, len}` from the byte form; malformed input is an error (whether it fits a
/// context is checked when it is restored).
#[rustler::nif(schedule = "DirtyCpu")]
fn kv_snapshot_from_binary<'a>(env: Env<'a>, b: Binary<'a>) -> Out<Term<'a>> {
    guard(|| {
        let s = Arc::new(KvSnapshot::from_bytes(b.as_slice())?);
        Ok(encode_snapshot(env, &s))
    })
}

/// `:ok` when the snapshot can be restored into the context's cache (same model layout and
/// KV types), else the reason.
#[rustler::nif]
fn kv_snapshot_check(c: ResourceArc<ContextRes>, s: ResourceArc<SnapshotRes>) -> Status {
    Status(guard(|| Ok(s.snapshot.check_layout(&c.kv_layout)?)))
}
