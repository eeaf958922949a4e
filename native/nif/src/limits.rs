//! Input limits, the engine's constants, and the KV cache's prefix rule.

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

/// Whether the first `n` positions of a sequence holding `len` can be continued when its
/// sliding-window layers (window `window`, 0 = none) dropped old blocks: the engine's rule,
/// for the Server's prefix matching.
#[rustler::nif]
fn kv_prefix_usable(len: usize, n: usize, window: usize) -> bool {
    llama_cpp_ex_engine::kv::window_keeps_prefix(len, n, (window > 0).then_some(window))
}

/// The bounds and defaults the engine enforces, for `LlamaCppEx.Limits.engine/0`: Elixir
/// validates against these instead of repeating them.
#[derive(NifMap)]
struct EngineLimits {
    max_context_tokens: usize,
    max_sequences: usize,
    max_threads: usize,
    max_top_logprobs: usize,
    default_context_tokens: usize,
    default_ubatch: usize,
}

#[rustler::nif]
fn engine_limits() -> EngineLimits {
    use llama_cpp_ex_engine::context as c;
    EngineLimits {
        max_context_tokens: c::MAX_CONTEXT_TOKENS,
        max_sequences: c::MAX_SEQUENCES,
        max_threads: llama_cpp_ex_engine::pool::max_threads(),
        max_top_logprobs: llama_cpp_ex_engine::sampler::MAX_TOP_LOGPROBS,
        default_context_tokens: c::DEFAULT_CONTEXT_TOKENS,
        default_ubatch: c::DEFAULT_UBATCH,
    }
}
