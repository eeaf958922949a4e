defmodule LlamaCppEx.Server.Config do
  @moduledoc false
  # A server's start options, validated once (the errors `start_link/1` and `init/1` return
  # are the contract's), with every default in one place.

  alias LlamaCppEx.{Context, Limits, Model, Options, Sampler}
  alias LlamaCppEx.Server.KvPolicy

  # `:n_batch` when none is given: min(n_ctx, this), the contract's
  @default_max_batch 2048

  @own [
    model_path: nil,
    n_gpu_layers: 99,
    requantize: true,
    quantize: :q8_0,
    n_parallel: 4,
    n_ctx: 8192,
    kv_budget_mb: nil,
    n_batch: nil,
    chunk_size: 512,
    max_queue: 64,
    embed_parallel: 32,
    embed_chunk: 64,
    pause_policy: nil,
    pause_poll_ms: 100,
    cache_prompt: true,
    kv_unified: true,
    prompt_cache_ram_mb: 0,
    draft_model: nil,
    kv_policy: nil,
    cluster: nil,
    batch_strategy: LlamaCppEx.Server.Strategy.DecodeMaximal,
    overlap: true
  ]

  # the strategies that plan every generating slot's decode row when nothing else waits: the
  # steps `:overlap` queues are exactly what they would plan
  @overlapping_strategies [
    LlamaCppEx.Server.Strategy.DecodeMaximal,
    LlamaCppEx.Server.Strategy.PrefillPriority,
    LlamaCppEx.Server.Strategy.Balanced,
    LlamaCppEx.Server.Strategy.Fair,
    LlamaCppEx.Server.Strategy.LatencyFirst,
    LlamaCppEx.Server.Strategy.ThroughputFirst
  ]

  defstruct Keyword.keys(@own) ++ [:sampler_defaults, :model_opts, :context_opts]

  @type t :: %__MODULE__{
          model_path: Path.t(),
          # accepted for llama_cpp_ex's code and forwarded to `Model.load/2`, where it does
          # nothing (the engine computes on the CPU)
          n_gpu_layers: integer(),
          requantize: boolean() | :all,
          quantize: atom(),
          n_parallel: pos_integer(),
          n_ctx: pos_integer(),
          kv_budget_mb: pos_integer() | nil,
          n_batch: pos_integer(),
          chunk_size: pos_integer(),
          max_queue: non_neg_integer(),
          embed_parallel: pos_integer(),
          embed_chunk: pos_integer(),
          pause_policy: module() | {module(), term()} | nil,
          pause_poll_ms: pos_integer(),
          cache_prompt: boolean(),
          kv_unified: boolean(),
          prompt_cache_ram_mb: non_neg_integer(),
          draft_model: LlamaCppEx.Model.t() | Path.t() | nil,
          kv_policy: KvPolicy.t() | nil,
          cluster: term(),
          batch_strategy: module(),
          overlap: boolean(),
          sampler_defaults: keyword(),
          model_opts: keyword(),
          context_opts: keyword()
        }

  @doc "Every option `LlamaCppEx.Server.start_link/1` accepts (besides `:name`)."
  @spec keys() :: [atom()]
  def keys do
    Enum.uniq(
      Keyword.keys(@own) ++
        Sampler.option_keys() ++
        Sampler.extra_keys() ++ Model.tuning_option_keys() ++ Context.tuning_option_keys()
    )
  end

  @doc "Validates `opts`: `{:ok, config}` or `{:error, contract_reason}`."
  @spec new(keyword()) :: {:ok, t()} | {:error, term()}
  def new(opts) do
    Options.validate!(opts, keys(), "LlamaCppEx.Server")
    own = Keyword.merge(@own, Keyword.take(opts, Keyword.keys(@own)))

    with {:ok, path} <- path(Keyword.fetch(opts, :model_path)),
         :ok <- strategy(own[:batch_strategy]),
         :ok <- pause_policy(own[:pause_policy]),
         :ok <- draft_model(own[:draft_model]),
         {:ok, kv_policy} <- kv_policy(own[:kv_policy], opts),
         :ok <- sizes(own) do
      n_ctx = own[:n_ctx]

      config =
        struct!(__MODULE__, own)
        |> Map.merge(%{
          model_path: path,
          kv_policy: kv_policy,
          n_batch: own[:n_batch] || min(n_ctx, @default_max_batch),
          sampler_defaults: Keyword.take(opts, Sampler.option_keys() ++ Sampler.extra_keys()),
          model_opts:
            Keyword.take(
              opts,
              Model.tuning_option_keys() ++ [:n_gpu_layers, :requantize, :quantize]
            ),
          context_opts:
            opts
            |> Keyword.take(Context.tuning_option_keys())
            |> Keyword.merge(
              n_ctx: n_ctx,
              n_batch: own[:n_batch] || min(n_ctx, @default_max_batch),
              # slots first, then one sequence per embedding text of a step
              n_seq_max: own[:n_parallel] + own[:embed_parallel],
              n_seq_embd: own[:embed_parallel]
            )
            |> Keyword.merge(kv_policy_types(kv_policy))
        })

      {:ok, config}
    end
  end

  @doc """
  Whether the server queues a decode step behind the one in flight (`:overlap`, with a
  built-in strategy and no pause policy, which is consulted before every step).
  """
  @spec overlap?(t()) :: boolean()
  def overlap?(%__MODULE__{} = cfg) do
    cfg.overlap and cfg.batch_strategy in @overlapping_strategies and cfg.pause_policy == nil
  end

  defp path(:error), do: {:error, {:missing_option, :model_path}}
  defp path({:ok, p}) when not is_binary(p), do: {:error, {:invalid_model_path, p}}

  # a GGUF file or a checkpoint directory; anything else (an empty directory too) fails here,
  # in start_link, rather than in the load after it
  defp path({:ok, p}) do
    if Model.source_kind(p) == :missing, do: {:error, {:model_not_found, p}}, else: {:ok, p}
  end

  defp strategy(mod) when not is_atom(mod) or is_nil(mod),
    do: {:error, {:invalid_batch_strategy, mod}}

  defp strategy(mod) do
    cond do
      not Code.ensure_loaded?(mod) ->
        {:error, {:invalid_batch_strategy, {:module_not_available, mod}}}

      # a plan-shaped module may leave out the contract's callback
      not function_exported?(mod, :build_batch, 4) and not function_exported?(mod, :plan, 4) ->
        {:error, {:invalid_batch_strategy, {:build_batch_4_not_exported, mod}}}

      true ->
        :ok
    end
  end

  @doc """
  What callers read from a running server's config (through the registry or `:fetch_model`)
  to prepare their requests in their own process: sampler defaults, the KV budget
  (`n_ctx`), `n_batch` and whether a draft model is attached.
  """
  @spec public(t()) :: %{
          sampler_defaults: keyword(),
          n_ctx: pos_integer(),
          n_batch: pos_integer(),
          draft_model?: boolean()
        }
  def public(cfg) do
    %{
      sampler_defaults: cfg.sampler_defaults,
      n_ctx: cfg.n_ctx,
      n_batch: cfg.n_batch,
      draft_model?: cfg.draft_model != nil
    }
  end

  @doc """
  The config with `:n_ctx` (and the context's KV size and batch) from `:kv_budget_mb` and the
  model's bytes per cached token in the chosen KV types; unchanged without a byte budget.
  """
  @spec resolve_budget(t(), non_neg_integer() | nil) :: t()
  def resolve_budget(%__MODULE__{kv_budget_mb: nil} = cfg, _bytes_per_token), do: cfg

  def resolve_budget(cfg, bytes_per_token) do
    n_ctx = max(div(cfg.kv_budget_mb * 1_048_576, bytes_per_token), 1)
    n_batch = min(cfg.n_batch, n_ctx)

    %{
      cfg
      | n_ctx: n_ctx,
        n_batch: n_batch,
        context_opts: Keyword.merge(cfg.context_opts, n_ctx: n_ctx, n_batch: n_batch)
    }
  end

  defp kv_policy(nil, _opts), do: {:ok, nil}

  defp kv_policy(policy_opts, opts) do
    with {:ok, policy} <- KvPolicy.new(policy_opts) do
      given = Keyword.take(opts, [:type_k, :type_v])

      case Enum.find(given, fn {_, t} -> t != policy.min end) do
        nil ->
          {:ok, policy}

        {key, t} ->
          {:error,
           {:invalid_kv_policy,
            "#{inspect(key)} #{inspect(t)} conflicts with :kv_policy, whose :min " <>
              "(#{inspect(policy.min)}) is the precision blocks start in"}}
      end
    end
  end

  # the cache holds the policy's levels: the first as its types, the others as pressure tiers
  defp kv_policy_types(nil), do: []

  defp kv_policy_types(policy) do
    [min | lower] = KvPolicy.levels(policy)
    [type_k: min, type_v: min, kv_pressure_types: lower]
  end

  defp draft_model(nil), do: :ok
  defp draft_model(%Model{}), do: :ok

  defp draft_model(path) when is_binary(path) do
    if Model.source_kind(path) == :missing, do: {:error, {:model_not_found, path}}, else: :ok
  end

  defp draft_model(other), do: {:error, {:invalid_draft_model, other}}

  defp pause_policy(nil), do: :ok
  defp pause_policy({mod, _arg}) when is_atom(mod), do: pause_policy(mod)

  defp pause_policy(mod) when is_atom(mod) do
    if Code.ensure_loaded?(mod) and function_exported?(mod, :pause_level, 2),
      do: :ok,
      else: {:error, {:invalid_pause_policy, mod}}
  end

  defp pause_policy(other), do: {:error, {:invalid_pause_policy, other}}

  defp sizes(own) do
    %{max_context_tokens: max_ctx, max_sequences: max_seqs} = Limits.engine()

    Options.check_all(Keyword.reject(own, fn {_, v} -> is_nil(v) end),
      n_parallel: {:int, 1, max_seqs},
      n_ctx: {:int, 1, max_ctx},
      n_batch: {:int, 1, max_ctx},
      chunk_size: {:int, 1, max_ctx},
      max_queue: {:int, 0, 1_000_000_000},
      embed_parallel: {:int, 1, 1024},
      embed_chunk: {:int, 1, max_ctx},
      kv_budget_mb: {:int, 1, 16_777_216},
      pause_poll_ms: {:int, 1, 3_600_000},
      cache_prompt: :boolean,
      kv_unified: :boolean,
      overlap: :boolean,
      prompt_cache_ram_mb: {:int, 0, 16_777_216}
    )
  end
end
