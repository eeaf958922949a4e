//! The GGUF reader and model loading on arbitrary bytes: a file from the Hub is untrusted.
//! Every input must give a model or an error, never a panic, an abort or a huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_cpp_ex_engine::gguf::GgufFile;
use llama_cpp_ex_engine::{LoadOptions, Model, Requantize};

fuzz_target!(|data: &[u8]| {
    let Ok(gguf) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    // the first byte past the header picks the load path: vocabulary only, as stored, or
    // requantized at load
    let opts = LoadOptions {
        vocab_only: data.get(24).is_some_and(|b| b & 3 == 0),
        requantize: if data.get(24).is_some_and(|b| b & 4 == 0) {
            Requantize::Off
        } else {
            Requantize::Q8_0
        },
        ..Default::default()
    };
    if let Ok(model) = Model::from_gguf(gguf, &opts) {
        // a loaded model's tokenizer works on text
        let _ = model
            .tokenizer
            .encode("Hello, world! <|im_start|>", true, true);
    }
});
