defmodule LlamaCppEx.NIF do
  @moduledoc false
  # Stubs for the Rust NIF (native/nif), grouped like its source files. Every function here is
  # replaced when the library loads; the bodies only run if loading failed.

  @on_load :load_nif

  def load_nif do
    path = :filename.join(:code.priv_dir(:llama_cpp_ex), ~c"native/llama_cpp_ex_nif")
    :erlang.load_nif(path, 0)
  end

  defp err, do: :erlang.nif_error(:nif_not_loaded)

  # model.rs
  def model_load(_path, _requantize, _vocab_only, _quantize, _placement), do: err()
  def gpu_devices, do: err()
  def model_info(_model), do: err()
  def model_metadata(_model), do: err()
  def kv_bytes_per_token(_model, _type_k, _type_v), do: err()
  def model_chat_template(_model), do: err()

  # embedding.rs
  def embed(_model, _texts, _pooling, _normalize, _n_ctx, _n_threads), do: err()
  def rerank(_model, _query, _documents, _n_ctx, _n_threads), do: err()

  # tokenizer.rs
  def tokenize(_model, _text, _add_special, _parse_special), do: err()
  def detokenize(_model, _tokens), do: err()
  def token_to_piece(_model, _token), do: err()
  def vocab_is_eog(_model, _token), do: err()

  # context.rs
  def context_create(_model, _opts), do: err()
  def context_n_ctx(_ctx), do: err()
  def context_n_seq_max(_ctx), do: err()
  def context_attach_draft(_ctx, _draft_model, _opts), do: err()
  def memory_clear(_ctx), do: err()
  def context_kv_usage(_ctx), do: err()
  def decode(_ctx, _tokens), do: err()
  def get_logits(_ctx, _idx), do: err()
  def get_top_logprobs(_ctx, _idx, _n), do: err()
  def context_step(_ctx, _step), do: err()

  # sampler.rs
  def sampler_defaults, do: err()
  def sampler_init(_model, _opts), do: err()
  def grammar_validate(_model, _grammar, _root), do: err()
  def grammar_from_json_schema(_schema_json, _mode), do: err()
  def sampler_grammar_stats(_sampler), do: err()
  def sampler_reset(_sampler), do: err()
  def sampler_accept(_sampler, _token), do: err()
  def sampler_sample_at(_sampler, _ctx, _idx), do: err()

  # snapshot.rs
  def kv_snapshot_to_binary(_snapshot), do: err()
  def kv_snapshot_from_binary(_binary), do: err()
  def kv_snapshot_check(_ctx, _snapshot), do: err()

  # engine.rs
  def engine_start(_ctx), do: err()
  def engine_submit(_engine, _pid, _ref, _step), do: err()
  def engine_stop(_engine), do: err()

  # limits.rs
  def limits_get, do: err()
  def limits_set(_limits), do: err()
  def engine_limits, do: err()
  def kv_prefix_usable(_len, _n, _window), do: err()
end
