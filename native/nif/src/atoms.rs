rustler::atoms! {
    ok,
    error,
    invalid_seq_id,
    invalid_grammar,
    part,
    f16,
    f32,
    all,
    scalar,
    llguidance,
}
