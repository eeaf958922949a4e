defmodule LlamaCppEx.NIF do
  @moduledoc false
  # Stubs for the Rust NIF (native/nif). Every function here is replaced when the library
  # loads; the bodies only run if loading failed.

  @on_load :load_nif

  def load_nif do
    path = :filename.join(:code.priv_dir(:llama_cpp_ex), ~c"native/llama_cpp_ex_nif")
    :erlang.load_nif(path, 0)
  end

  defp err, do: :erlang.nif_error(:nif_not_loaded)

  def backend_init, do: err()
  def cancel_flag_new, do: err()
  def request_cancel(_flag), do: err()
  def cancel_requested(_flag), do: err()

  def model_load(_path, _requantize, _vocab_only), do: err()
  def model_n_ctx_train(_model), do: err()
  def model_n_embd(_model), do: err()
  def model_n_layer(_model), do: err()
  def model_n_params(_model), do: err()
  def model_size(_model), do: err()
  def model_desc(_model), do: err()
  def model_chat_template(_model), do: err()
  def model_architecture(_model), do: err()
  def model_swa_window(_model), do: err()
  def model_metadata(_model), do: err()

  def vocab_n_tokens(_model), do: err()
  def vocab_bos(_model), do: err()
  def vocab_eos(_model), do: err()
  def vocab_is_eog(_model, _token), do: err()
  def tokenize(_model, _text, _add_special, _parse_special), do: err()
  def detokenize(_model, _tokens), do: err()
  def token_to_piece(_model, _token), do: err()
  def chat_apply_template(_model, _messages, _add_assistant, _enable_thinking, _kwargs), do: err()

  def context_create(
        _model,
        _n_ctx,
        _n_batch,
        _n_ubatch,
        _n_threads,
        _n_threads_batch,
        _n_seq_max,
        _kv_type
      ),
      do: err()

  def context_n_ctx(_ctx), do: err()
  def context_n_seq_max(_ctx), do: err()
  def context_can_seq_rm(_ctx), do: err()
  def context_kv_usage(_ctx), do: err()
  def memory_clear(_ctx), do: err()
  def memory_seq_rm(_ctx, _seq, _p0, _p1), do: err()
  def memory_seq_cp(_ctx, _src, _dst, _p0, _p1), do: err()
  def memory_seq_pos_max(_ctx, _seq), do: err()
  def decode(_ctx, _tokens), do: err()
  def batch_eval(_ctx, _entries), do: err()
  def get_logits(_ctx, _idx), do: err()
  def get_top_logprobs(_ctx, _idx, _n), do: err()

  def sampler_init(
        _model,
        _seed,
        _temp,
        _top_k,
        _top_p,
        _min_p,
        _penalty_repeat,
        _penalty_freq,
        _penalty_present,
        _grammar,
        _grammar_root,
        _logprobs,
        _extras
      ),
      do: err()

  def grammar_validate(_model, _grammar, _root), do: err()
  def grammar_from_json_schema(_schema_json, _mode), do: err()

  def sampler_reset(_sampler), do: err()
  def sampler_grammar_stats(_sampler), do: err()
  def sampler_accept(_sampler, _token), do: err()
  def sampler_sample_at(_sampler, _ctx, _idx), do: err()

  def generate(_ctx, _sampler, _prompt, _max_tokens, _cancel), do: err()

  def engine_start(_ctx), do: err()
  def engine_submit(_engine, _pid, _ref, _ops, _entries, _samplers, _purgeable), do: err()
  def engine_stop(_engine), do: err()

  def generate_tokens(_ctx, _sampler, _prompt, _max_tokens, _pid, _ref, _cancel), do: err()
end
