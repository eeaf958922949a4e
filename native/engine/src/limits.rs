//! Bounds on inputs whose cost grows with their size or shape: grammars, JSON Schemas and chat
//! templates (which may come from an untrusted GGUF). Every limit is checked before the
//! expensive or recursive work starts, and the error names the limit.
//!
//! Limits can be lowered or raised at run time ([`set_limits`], `LlamaCppEx.Limits` in
//! Elixir) up to hard caps: the recursion depth the largest allowed input can cause must fit
//! the stack of [`crate::stack::on_deep_stack`].

use std::sync::RwLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of grammar text (GBNF or Lark) or JSON Schema text.
    pub grammar_bytes: usize,
    /// Rules of a GBNF grammar.
    pub grammar_rules: usize,
    /// Nesting of groups and repetitions in a grammar, and of subschemas in a JSON Schema.
    pub grammar_nesting: usize,
    /// Properties of one object of a JSON Schema.
    pub schema_properties: usize,
    /// Optional properties of one object of a JSON Schema (each adds alternatives for every
    /// later one).
    pub schema_optional_properties: usize,
    /// Subschemas visited in a JSON Schema.
    pub schema_nodes: usize,
    /// minijinja fuel of one chat template render: about one per instruction and per 64 bytes
    /// of data, so it bounds both time and memory.
    pub template_fuel: u64,
    /// Bytes of one rendered chat prompt.
    pub template_output_bytes: usize,
    /// Nesting of a value a template prints or serialises.
    pub template_value_depth: usize,
}

/// The defaults.
pub const DEFAULT_LIMITS: Limits = Limits {
    grammar_bytes: 1 << 20,
    grammar_rules: 10_000,
    grammar_nesting: 64,
    schema_properties: 1024,
    schema_optional_properties: 256,
    schema_nodes: 20_000,
    template_fuel: 4_000_000,
    template_output_bytes: 16 << 20,
    template_value_depth: 128,
};

/// The largest values [`set_limits`] accepts.
pub const MAX_LIMITS: Limits = Limits {
    grammar_bytes: 16 << 20,
    grammar_rules: 100_000,
    grammar_nesting: 256,
    schema_properties: 4096,
    schema_optional_properties: 1024,
    schema_nodes: 200_000,
    template_fuel: 100_000_000,
    template_output_bytes: 256 << 20,
    template_value_depth: 1024,
};

static LIMITS: RwLock<Limits> = RwLock::new(DEFAULT_LIMITS);

/// The limits in force.
pub fn limits() -> Limits {
    *LIMITS.read().unwrap_or_else(|e| e.into_inner())
}

/// Replaces the limits; every value must be positive and at most its [`MAX_LIMITS`] entry.
pub fn set_limits(new: Limits) -> Result<(), String> {
    let checks: [(&str, u64, u64); 9] = [
        (
            "grammar_bytes",
            new.grammar_bytes as u64,
            MAX_LIMITS.grammar_bytes as u64,
        ),
        (
            "grammar_rules",
            new.grammar_rules as u64,
            MAX_LIMITS.grammar_rules as u64,
        ),
        (
            "grammar_nesting",
            new.grammar_nesting as u64,
            MAX_LIMITS.grammar_nesting as u64,
        ),
        (
            "schema_properties",
            new.schema_properties as u64,
            MAX_LIMITS.schema_properties as u64,
        ),
        (
            "schema_optional_properties",
            new.schema_optional_properties as u64,
            MAX_LIMITS.schema_optional_properties as u64,
        ),
        (
            "schema_nodes",
            new.schema_nodes as u64,
            MAX_LIMITS.schema_nodes as u64,
        ),
        ("template_fuel", new.template_fuel, MAX_LIMITS.template_fuel),
        (
            "template_output_bytes",
            new.template_output_bytes as u64,
            MAX_LIMITS.template_output_bytes as u64,
        ),
        (
            "template_value_depth",
            new.template_value_depth as u64,
            MAX_LIMITS.template_value_depth as u64,
        ),
    ];
    for (name, value, max) in checks {
        if value == 0 || value > max {
            return Err(format!("limit {name} must be in 1..={max}, got {value}"));
        }
    }
    *LIMITS.write().unwrap_or_else(|e| e.into_inner()) = new;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_range_checked() {
        assert!(set_limits(Limits {
            grammar_nesting: 0,
            ..DEFAULT_LIMITS
        })
        .is_err());
        let err = set_limits(Limits {
            template_fuel: MAX_LIMITS.template_fuel + 1,
            ..DEFAULT_LIMITS
        })
        .unwrap_err();
        assert!(err.contains("template_fuel"), "{err}");
        assert_eq!(limits(), DEFAULT_LIMITS);
    }
}
