rustler::atoms! {
    ok,
    error,
    invalid_seq_id,
    invalid_grammar,
    f16,
    f32,
    q8_0,
    q4_0,
    all,
    scalar,
    llguidance,
}
