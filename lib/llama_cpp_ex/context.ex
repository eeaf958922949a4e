defmodule LlamaCppEx.Context do
  @moduledoc """
  An inference context: a paged KV cache sized by `:n_ctx` (shared by up to `:n_seq_max`
  sequences) and the logits of the last evaluation.

  A context keeps its model alive. Calls on one context are serialised; use one context per
  concurrent generation, or `LlamaCppEx.Server` to batch many requests in one context.

  ## Example

      {:ok, ctx} = LlamaCppEx.Context.create(model, n_ctx: 1024)
      {:ok, sampler} = LlamaCppEx.Sampler.create(model, temp: 0.0)
      {:ok, tokens} = LlamaCppEx.Tokenizer.encode(model, "The capital of France is")
      {:ok, text} = LlamaCppEx.Context.generate(ctx, sampler, tokens, max_tokens: 8)
  """

  alias LlamaCppEx.{Model, NIF, Options, Sampler}

  @enforce_keys [:ref, :model]
  defstruct [:ref, :model]

  @type t :: %__MODULE__{ref: reference(), model: Model.t()}

  @tuning_keys [
    :n_batch,
    :n_ubatch,
    :n_threads,
    :n_threads_batch,
    :type_k,
    :type_v,
    :flash_attn,
    :offload_kqv,
    :op_offload,
    :rope_scaling_type,
    :rope_freq_base,
    :rope_freq_scale,
    :yarn_ext_factor,
    :yarn_attn_factor,
    :yarn_beta_fast,
    :yarn_beta_slow,
    :yarn_orig_ctx,
    :attention_type,
    :no_perf,
    :swa_full
  ]
  @structural_keys [
    :n_ctx,
    :embeddings,
    :pooling_type,
    :ctx_type,
    :n_seq_max,
    :kv_unified,
    :n_rs_seq
  ]
  @kv_types [:f32, :f16, :q4_0, :q4_1, :q5_0, :q5_1, :q8_0, :bf16]

  @doc "Options that tune a context without changing what it computes."
  @spec tuning_option_keys() :: [atom()]
  def tuning_option_keys, do: @tuning_keys

  @doc "Options that change what a context holds."
  @spec structural_option_keys() :: [atom()]
  def structural_option_keys, do: @structural_keys

  @doc """
  The default worker-thread count: the number of online schedulers.

  The engine's worker pool and the BEAM's schedulers share the same cores; see
  `docs/performance.md` for the `+sbwt none` VM flags that stop idle schedulers from spinning.
  """
  @spec default_threads() :: pos_integer()
  def default_threads, do: System.schedulers_online()

  @doc """
  Creates a context.

  ## Options

    * `:n_ctx` - KV cache size in tokens, shared by all sequences. Default 2048.
    * `:n_batch` - the most tokens one `decode/2` or batch may hold. Default `n_ctx`.
    * `:n_ubatch` - tokens per forward pass; larger batches are split. Default 512.
    * `:n_threads` - threads a one-token forward pass (decoding) of this context uses: the
      calling thread plus workers of the engine's pool, which sleep when idle. Default
      `default_threads/0`.
    * `:n_threads_batch` - the same for passes over several tokens (prompt processing,
      batches of sequences). Default `:n_threads`.
    * `:n_seq_max` - number of sequences. Default 1.
    * `:type_k` / `:type_v` - KV precision, `:f16` (default) or `:f32`; other llama.cpp types
      are accepted and stored as f16.
    * every other llama.cpp context option (`:flash_attn`, `:offload_kqv`, rope and yarn
      overrides, ...) is accepted for compatibility and has no effect on this engine.

  Returns `{:error, message}` for sizes that are not positive or exceed the engine's bounds.
  """
  @spec create(Model.t(), keyword()) :: {:ok, t()} | {:error, String.t()}
  def create(%Model{ref: mref} = model, opts \\ []) do
    Options.validate!(opts, @tuning_keys ++ @structural_keys, "LlamaCppEx.Context.create/2")
    n_ctx = Keyword.get(opts, :n_ctx, 2048)
    n_batch = Keyword.get(opts, :n_batch, n_ctx)
    n_ubatch = Keyword.get(opts, :n_ubatch, 512)
    n_threads = Keyword.get(opts, :n_threads) || default_threads()
    n_threads_batch = Keyword.get(opts, :n_threads_batch) || n_threads
    n_seq_max = Keyword.get(opts, :n_seq_max, 1)
    type_k = Keyword.get(opts, :type_k, :f16)

    with :ok <- check_int(:n_ctx, n_ctx),
         :ok <- check_int(:n_batch, n_batch),
         :ok <- check_int(:n_ubatch, n_ubatch),
         :ok <- check_int(:n_threads, n_threads),
         :ok <- check_int(:n_threads_batch, n_threads_batch),
         :ok <- check_int(:n_seq_max, n_seq_max),
         :ok <- check_kv_type(type_k),
         {:ok, ref} <-
           NIF.context_create(
             mref,
             n_ctx,
             n_batch,
             n_ubatch,
             n_threads,
             n_threads_batch,
             n_seq_max,
             kv(type_k)
           ) do
      {:ok, %__MODULE__{ref: ref, model: model}}
    end
  end

  defp kv(:f32), do: :f32
  defp kv(_), do: :f16

  defp check_int(_key, v) when is_integer(v) and v > 0, do: :ok

  defp check_int(key, v),
    do: {:error, "failed to create context: #{key} must be a positive integer, got #{inspect(v)}"}

  defp check_kv_type(t) when t in @kv_types, do: :ok
  defp check_kv_type(t), do: {:error, "failed to create context: unknown KV type #{inspect(t)}"}

  @doc "KV cache size in tokens."
  @spec n_ctx(t()) :: pos_integer()
  def n_ctx(%__MODULE__{ref: ref}), do: NIF.context_n_ctx(ref)

  @doc "Number of sequences."
  @spec n_seq_max(t()) :: pos_integer()
  def n_seq_max(%__MODULE__{ref: ref}), do: NIF.context_n_seq_max(ref)

  @doc "Recurrent-state sequences (always 0: transformer KV only)."
  @spec n_rs_seq(t()) :: 0
  def n_rs_seq(%__MODULE__{}), do: 0

  @doc "Clears the whole KV cache."
  @spec clear(t()) :: :ok
  def clear(%__MODULE__{ref: ref}), do: NIF.memory_clear(ref)

  @doc """
  Appends `tokens` to sequence 0 and evaluates them; logits are kept for the last token.
  """
  @spec decode(t(), [integer()]) :: :ok | {:error, String.t()}
  def decode(%__MODULE__{ref: ref}, tokens) when is_list(tokens) do
    with :ok <- LlamaCppEx.Tokenizer.check_ids(tokens) do
      decode_checked(ref, tokens)
    end
  end

  defp decode_checked(ref, tokens) do
    case NIF.decode(ref, tokens) do
      :ok -> :ok
      {:error, msg} when is_binary(msg) -> {:error, msg}
      {:error, other} -> {:error, inspect(other)}
    end
  end

  @doc """
  Evaluates `prompt_tokens` from an empty sequence 0 and generates up to `:max_tokens`
  (default 256) tokens with `sampler`. `:cancel` takes a cancel flag
  (`LlamaCppEx.NIF.cancel_flag_new/0`); cancelling returns the text generated so far.
  """
  @spec generate(t(), Sampler.t(), [integer()], keyword()) ::
          {:ok, String.t()} | {:error, String.t()}
  def generate(%__MODULE__{ref: ref}, %Sampler{ref: sref}, tokens, opts \\ []) do
    Options.validate!(opts, [:max_tokens, :cancel], "LlamaCppEx.Context.generate/4")
    max_tokens = Keyword.get(opts, :max_tokens, 256)
    cancel = Keyword.get_lazy(opts, :cancel, &NIF.cancel_flag_new/0)

    cond do
      not is_integer(max_tokens) or max_tokens <= 0 ->
        {:error, "max_tokens must be a positive integer, got #{inspect(max_tokens)}"}

      tokens == [] ->
        {:error, "prompt cannot be empty"}

      true ->
        with :ok <- LlamaCppEx.Tokenizer.check_ids(tokens) do
          NIF.generate(ref, sref, tokens, max_tokens, cancel)
        end
    end
  end

  @doc """
  The `n` most likely tokens and their log-probabilities for entry `idx` of the last batch
  (-1 = the last entry with logits), from the raw logits — llama.cpp's `n_probs`.
  """
  @spec top_logprobs(t(), integer(), non_neg_integer()) ::
          {:ok, [{non_neg_integer(), float()}]} | {:error, String.t()}
  def top_logprobs(%__MODULE__{ref: ref}, idx \\ -1, n) when is_integer(n) and n >= 0 do
    NIF.get_top_logprobs(ref, idx, n)
  end

  @doc "The raw logits of entry `idx` of the last batch (-1 = last entry with logits)."
  @spec logits(t(), integer()) :: {:ok, [float()]} | {:error, String.t()}
  def logits(%__MODULE__{ref: ref}, idx \\ -1), do: NIF.get_logits(ref, idx)

  @doc """
  Block usage of the KV cache after an integrity audit:
  `%{n_blocks: n, used: [per layer group], owners: [[{seq_id, blocks}]]}`.
  """
  @spec kv_usage(t()) :: {:ok, map()} | {:error, String.t()}
  def kv_usage(%__MODULE__{ref: ref}) do
    with {:ok, {n, used, owners}} <- NIF.context_kv_usage(ref) do
      {:ok, %{n_blocks: n, used: used, owners: owners}}
    end
  end
end
