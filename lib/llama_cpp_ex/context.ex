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

  ## Options that do nothing here, and options that are refused

  Accepted for compatibility with `llama_cpp_ex` and without effect on this engine:
  `:flash_attn` (attention is always the engine's blocked kernel), `:offload_kqv` and
  `:op_offload` (no GPU), `:no_perf`, `:swa_full` (sliding-window layers keep what they can
  still attend to, and prefix reuse across requests is decided by the server), `:kv_unified`
  (a context's cache is always shared by its sequences), `:pooling_type` without
  `:embeddings`.

  Refused with `{:error, reason}` because honouring them would change results or memory in a
  way this engine does not implement: KV types other than `:f16`, `:f32`, `:q8_0` and
  `:q4_0`, RoPE and YaRN overrides (`:rope_scaling_type` other than
  `:unspecified`, non-zero `:rope_freq_base` / `:rope_freq_scale`, `:yarn_*` other than
  their "from the model" defaults), `attention_type: :non_causal`, `embeddings: true` (use
  `LlamaCppEx.embed/3`), `ctx_type: :mtp` and `:n_rs_seq` other than 0.
  """

  alias LlamaCppEx.{Generation, Limits, Model, NIF, Options, Sampler, Stepper}

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
    :n_seq_embd,
    :kv_unified,
    :n_rs_seq,
    :kv_pressure_types
  ]
  @llama_kv_types [:f32, :f16, :q4_0, :q4_1, :q5_0, :q5_1, :q8_0, :bf16]
  @kv_types [:f16, :f32, :q8_0, :q4_0]

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

    * `:n_ctx` - KV cache size in tokens, shared by all sequences; no sequence grows past it.
      Default 2048.
    * `:n_batch` - the most tokens one `decode/2` or batch may hold. Default `n_ctx`.
    * `:n_ubatch` - tokens per forward pass; larger batches are split. Default 512.
    * `:n_threads` - threads a one-token forward pass (decoding) of this context uses: the
      calling thread plus workers of the engine's pool, which sleep when idle. At most twice
      the machine's cores. Default `default_threads/0`.
    * `:n_threads_batch` - the same for passes over several tokens (prompt processing,
      batches of sequences). Default `:n_threads`.
    * `:n_seq_max` - number of sequences. Default 1.
    * `:n_seq_embd` - of those, how many (the last ones) hold embedding texts for one step
      only (`LlamaCppEx.Server.embed/3`): they borrow KV blocks from the `:n_ctx` budget
      instead of adding to it. Default 0.
    * `:type_k` / `:type_v` - KV precision of keys / values: `:f16` (default), `:f32`,
      `:q8_0` (about half of f16's memory per token) or `:q4_0` (about 0.28×), llama.cpp's
      block formats, each chosen independently (`:type_v` defaults to `:type_k`). Quantized
      types need a head size that is a multiple of 32. The cache stays quantized; attention
      dequantizes one head row at a time as it reads.
    * `:kv_pressure_types` - lower precisions (`[:q8_0]`, `[:q4_0]` or `[:q8_0, :q4_0]`, each
      smaller than the one before and than `:type_k`/`:type_v`) that blocks written later may
      take, within the byte budget `:n_ctx` tokens take at `:type_k`/`:type_v`. A Server's
      `:kv_policy` sets it and switches between them (`LlamaCppEx.Server.KvPolicy`); a context
      used directly writes in `:type_k`/`:type_v`. Default `[]`.
    * the options listed under "Options that do nothing here".

  Returns `{:error, message}` for values of the wrong type, out of range, or refused (see
  above).
  """
  @spec create(Model.t(), keyword()) :: {:ok, t()} | {:error, String.t()}
  def create(%Model{ref: mref} = model, opts \\ []) do
    Options.validate!(opts, @tuning_keys ++ @structural_keys, "LlamaCppEx.Context.create/2")

    with {:ok, native} <- native_opts(opts),
         {:ok, ref} <- NIF.context_create(mref, native) do
      {:ok, %__MODULE__{ref: ref, model: model}}
    else
      {:error, msg} -> {:error, "failed to create context: #{msg}"}
    end
  end

  @doc """
  Gives `ctx` a draft model for speculative decoding (`speculative: [mode: :draft]`): a
  context of `draft` (a `LlamaCppEx.Model`, or a GGUF path loaded here) made with `opts`
  (those of `create/2`), whose sequences shadow the context's. The draft model must share
  the context model's vocabulary and `opts` must hold at least as many sequences
  (`:n_seq_max`) as the context.
  """
  @spec attach_draft(t(), Model.t() | Path.t(), keyword()) :: :ok | {:error, String.t()}
  def attach_draft(%__MODULE__{ref: ref}, draft, opts \\ []) do
    Options.validate!(opts, @tuning_keys ++ @structural_keys, "LlamaCppEx.Context.attach_draft/3")

    with {:ok, native} <- native_opts(opts),
         {:ok, %Model{ref: dref}} <-
           if(is_binary(draft), do: Model.load(draft), else: {:ok, draft}),
         :ok <- NIF.context_attach_draft(ref, dref, native) do
      :ok
    else
      {:error, msg} -> {:error, "failed to attach the draft model: #{msg}"}
    end
  end

  defp native_opts(opts) do
    limits = Limits.engine()
    n_ctx = Keyword.get(opts, :n_ctx, limits.default_context_tokens)

    with :ok <- check_sizes(opts),
         :ok <- check_refused(opts),
         {:ok, {type_k, type_v}} <- kv_types(opts) do
      n_threads = Keyword.get(opts, :n_threads) || default_threads()

      {:ok,
       %{
         n_ctx: n_ctx,
         n_batch: Keyword.get(opts, :n_batch) || n_ctx,
         n_ubatch: Keyword.get(opts, :n_ubatch, limits.default_ubatch),
         n_threads: n_threads,
         n_threads_batch: Keyword.get(opts, :n_threads_batch) || n_threads,
         n_seq_max: Keyword.get(opts, :n_seq_max, 1),
         n_seq_embd: Keyword.get(opts, :n_seq_embd, 0),
         type_k: type_k,
         type_v: type_v,
         kv_pressure_types: Keyword.get(opts, :kv_pressure_types, [])
       }}
    end
  end

  defp check_sizes(opts) do
    %{max_context_tokens: max_ctx, max_sequences: max_seqs, max_threads: max_threads} =
      Limits.engine()

    Options.check_all(opts,
      n_ctx: {:int, 1, max_ctx},
      n_batch: {:int, 1, max_ctx},
      n_ubatch: {:int, 1, max_ctx},
      n_threads: {:int, 1, max_threads},
      n_threads_batch: {:int, 1, max_threads},
      n_seq_max: {:int, 1, max_seqs},
      n_seq_embd: {:int, 0, max_seqs},
      flash_attn: {:in, [:auto, :enabled, :disabled, true, false]},
      offload_kqv: :boolean,
      op_offload: :boolean,
      no_perf: :boolean,
      swa_full: :boolean,
      kv_unified: :boolean,
      embeddings: :boolean,
      pooling_type: {:in, [:unspecified, :none, :mean, :cls, :last, :rank]},
      ctx_type: {:in, [:default, :mtp]},
      attention_type: {:in, [:unspecified, :causal, :non_causal]},
      rope_scaling_type: {:in, [:unspecified, :none, :linear, :yarn, :longrope]},
      n_rs_seq: {:int, 0, max_seqs},
      kv_pressure_types: {:list, {:in, [:q8_0, :q4_0]}}
    )
  end

  # option => the value that means "as the model says"; anything else is refused
  @model_defaults [
    rope_scaling_type: :unspecified,
    rope_freq_base: 0.0,
    rope_freq_scale: 0.0,
    yarn_ext_factor: -1.0,
    yarn_attn_factor: -1.0,
    yarn_beta_fast: -1.0,
    yarn_beta_slow: -1.0,
    yarn_orig_ctx: 0,
    embeddings: false,
    ctx_type: :default,
    n_rs_seq: 0
  ]

  defp check_refused(opts) do
    refused =
      Enum.find(@model_defaults, fn {key, default} ->
        case Keyword.fetch(opts, key) do
          {:ok, v} -> v != default and not (is_number(v) and is_number(default) and v == default)
          :error -> false
        end
      end)

    cond do
      refused ->
        {key, default} = refused

        {:error,
         "option #{inspect(key)} is not supported by this engine " <>
           "(only #{inspect(default)}, its default), got #{inspect(opts[key])}"}

      Keyword.get(opts, :attention_type) == :non_causal ->
        {:error, "option :attention_type :non_causal is not supported (use LlamaCppEx.embed/3)"}

      true ->
        :ok
    end
  end

  @doc false
  # `{:ok, {type_k, type_v}}` from context options (defaults applied), or `{:error, message}`:
  # also how a Server turns a byte budget into tokens.
  @spec kv_types(keyword()) :: {:ok, {atom(), atom()}} | {:error, String.t()}
  def kv_types(opts) do
    type_k = Keyword.get(opts, :type_k, :f16)
    type_v = Keyword.get(opts, :type_v, type_k)

    cond do
      type_k not in @llama_kv_types or type_v not in @llama_kv_types ->
        {:error,
         "unknown KV cache type #{inspect(if type_k in @llama_kv_types, do: type_v, else: type_k)} (expected one of #{inspect(@llama_kv_types)})"}

      type_k not in @kv_types or type_v not in @kv_types ->
        bad = if type_k in @kv_types, do: type_v, else: type_k

        {:error,
         "unsupported KV cache type #{inspect(bad)} (supported: :f16, :f32, :q8_0, :q4_0)"}

      true ->
        {:ok, {type_k, type_v}}
    end
  end

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
  `{:error, "context full ..."}` when the sequence would grow past `:n_ctx`.
  """
  @spec decode(t(), [integer()]) :: :ok | {:error, String.t()}
  def decode(%__MODULE__{ref: ref}, tokens) do
    with :ok <- LlamaCppEx.Tokenizer.check_ids(tokens) do
      NIF.decode(ref, tokens)
    end
  end

  @doc """
  Evaluates `prompt_tokens` from an empty sequence 0 and generates up to `:max_tokens`
  (default 256) tokens with `sampler`, one engine step at a time in the calling process.
  `:cancel` takes a flag from `cancel_flag/0`: once `cancel/1` sets it (from any process),
  generation stops before its next step and returns the text generated so far.

  Errors: `{:error, :empty_prompt}`, `{:error, :invalid_token}` (an id outside the
  vocabulary), `{:error, "invalid max_tokens: ..."}`, `{:error, :context_full}` when the
  sequence outgrows the context, and the engine's message for anything else.
  """
  @spec generate(t(), Sampler.t(), [integer()], keyword()) :: {:ok, String.t()} | {:error, term()}
  def generate(%__MODULE__{model: model} = ctx, %Sampler{} = sampler, tokens, opts \\ []) do
    Options.validate!(opts, [:max_tokens, :cancel], "LlamaCppEx.Context.generate/4")
    max_tokens = Keyword.get(opts, :max_tokens, Generation.default_max_tokens())
    cancel = Keyword.get(opts, :cancel)

    with :ok <- Options.check(:max_tokens, max_tokens, {:int, 1, Limits.max_context()}),
         {:ok, tokens} <- Generation.tokens(model, tokens) do
      ctx |> Stepper.on_context(sampler, tokens, max_tokens) |> drive(cancel, [])
    end
  end

  defp drive(stepper, cancel, text) do
    if cancel != nil and cancelled?(cancel) do
      {:ok, IO.iodata_to_binary(text)}
    else
      {status, events, stepper} = Stepper.step(stepper)
      text = [text | for({:token, t} <- events, do: t)]

      case {status, List.last(events)} do
        {:done, {:error, reason}} -> {:error, reason}
        {:done, _} -> {:ok, IO.iodata_to_binary(text)}
        {:cont, _} -> drive(stepper, cancel, text)
      end
    end
  end

  @typedoc "A flag that stops `generate/4` (see `cancel_flag/0`)."
  @opaque cancel_flag :: :atomics.atomics_ref()

  @doc """
  A cancel flag for `generate/4`'s `:cancel` option; `cancel/1` sets it from any process.
  """
  @spec cancel_flag() :: cancel_flag()
  def cancel_flag, do: :atomics.new(1, [])

  @doc "Sets a cancel flag: the `generate/4` call watching it stops before its next step."
  @spec cancel(cancel_flag()) :: :ok
  def cancel(flag), do: :atomics.put(flag, 1, 1)

  defp cancelled?(flag), do: :atomics.get(flag, 1) == 1

  @doc """
  The `n` most likely tokens and their log-probabilities for entry `idx` of the last batch
  (-1 = the last entry with logits), from the raw logits — llama.cpp's `n_probs`.
  """
  @spec top_logprobs(t(), integer(), non_neg_integer()) ::
          {:ok, [{non_neg_integer(), float()}]} | {:error, String.t()}
  def top_logprobs(%__MODULE__{ref: ref}, idx \\ -1, n) do
    with :ok <- Options.check(:idx, idx, {:int, -1, 2 ** 32}),
         :ok <- Options.check(:n, n, {:int, 0, 2 ** 32}) do
      NIF.get_top_logprobs(ref, idx, n)
    end
  end

  @doc "The raw logits of entry `idx` of the last batch (-1 = last entry with logits)."
  @spec logits(t(), integer()) :: {:ok, [float()]} | {:error, String.t()}
  def logits(%__MODULE__{ref: ref}, idx \\ -1) do
    with :ok <- Options.check(:idx, idx, {:int, -1, 2 ** 32}), do: NIF.get_logits(ref, idx)
  end

  @doc """
  Block usage of the KV cache after an integrity audit:
  `%{n_blocks: n, used: [per layer group], owners: [[{seq_id, blocks}]], tokens: %{seq_id =>
  positions held}}`.
  """
  @spec kv_usage(t()) :: {:ok, map()} | {:error, String.t()}
  def kv_usage(%__MODULE__{ref: ref}) do
    with {:ok, {n, used, owners, tokens}} <- NIF.context_kv_usage(ref) do
      {:ok, %{n_blocks: n, used: used, owners: owners, tokens: Map.new(tokens)}}
    end
  end
end
