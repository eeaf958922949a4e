//! Input limits, the KV cache's block size and prefix rule, and the SIMD level in use.

use crate::error::{guard, message, Status};
use llama_cpp_ex_engine::limits::{limits, set_limits, Limits};
use rustler::NifMap;

/// `LlamaCppEx.Limits`' map (see `llama_cpp_ex_engine::limits`).
#[derive(NifMap)]
struct LimitsTerm {
    grammar_bytes: usize,
    grammar_rules: usize,
    grammar_nesting: usize,
    schema_properties: usize,
    schema_optional_properties: usize,
    schema_nodes: usize,
    template_fuel: u64,
    template_output_bytes: usize,
    template_value_depth: usize,
}

#[rustler::nif]
fn limits_get() -> LimitsTerm {
    let l = limits();
    LimitsTerm {
        grammar_bytes: l.grammar_bytes,
        grammar_rules: l.grammar_rules,
        grammar_nesting: l.grammar_nesting,
        schema_properties: l.schema_properties,
        schema_optional_properties: l.schema_optional_properties,
        schema_nodes: l.schema_nodes,
        template_fuel: l.template_fuel,
        template_output_bytes: l.template_output_bytes,
        template_value_depth: l.template_value_depth,
    }
}

#[rustler::nif]
fn limits_set(l: LimitsTerm) -> Status {
    Status(guard(|| {
        set_limits(Limits {
            grammar_bytes: l.grammar_bytes,
            grammar_rules: l.grammar_rules,
            grammar_nesting: l.grammar_nesting,
            schema_properties: l.schema_properties,
            schema_optional_properties: l.schema_optional_properties,
            schema_nodes: l.schema_nodes,
            template_fuel: l.template_fuel,
            template_output_bytes: l.template_output_bytes,
            template_value_depth: l.template_value_depth,
        })
        .map_err(message)
    }))
}

#[rustler::nif]
fn kv_block_size() -> usize {
    llama_cpp_ex_engine::kv::KV_BLOCK_SIZE
}

/// Whether the first `n` positions of a sequence holding `len` can be continued when its
/// sliding-window layers (window `window`, 0 = none) dropped old blocks: the engine's rule,
/// for the Server's prefix matching.
#[rustler::nif]
fn kv_prefix_usable(len: usize, n: usize, window: usize) -> bool {
    llama_cpp_ex_engine::kv::window_keeps_prefix(len, n, (window > 0).then_some(window))
}

#[rustler::nif]
fn simd_level() -> &'static str {
    llama_cpp_ex_engine::kernels::simd_level().name()
}
