defmodule LlamaCppEx.Server.PromptCache do
  @moduledoc false
  # The level-2 prompt cache (`:prompt_cache_ram_mb`): copies of KV prefixes in host RAM,
  # outside the KV budget, keyed by their tokens and cache scope. A slot's cache is copied
  # when it is about to be lost (another request overwrites it, or the engine evicts it under
  # KV pressure); a later request whose prompt starts with an entry's tokens gets the entry's
  # blocks restored instead of evaluating them again. Entries are engine snapshots (NIF
  # resources); this module only decides. FIFO eviction under the byte budget.

  defstruct budget: 0,
            bytes: 0,
            entries: [],
            next_tag: 1,
            # save ops in flight: tag => {tokens, scope, reply_to | nil}
            pending: %{},
            hits: 0,
            saves: 0,
            evictions: 0

  @type entry :: %{
          tokens: [non_neg_integer()],
          len: non_neg_integer(),
          scope: term(),
          ref: reference(),
          bytes: non_neg_integer()
        }
  @type t :: %__MODULE__{
          budget: non_neg_integer(),
          bytes: non_neg_integer(),
          entries: [entry()],
          next_tag: pos_integer(),
          pending: %{pos_integer() => {[non_neg_integer()], term(), GenServer.from() | nil}},
          hits: non_neg_integer(),
          saves: non_neg_integer(),
          evictions: non_neg_integer()
        }

  # shorter prefixes are cheaper to evaluate again than to keep
  @min_tokens 32
  # a restore must bring at least this share of an entry (the contract's 25 %)
  @min_share 0.25
  # a prefix written to disk is not bounded by the RAM budget
  @unbounded 4_611_686_018_427_387_904

  @spec new(non_neg_integer()) :: t()
  def new(mb), do: %__MODULE__{budget: mb * 1_048_576}

  @spec enabled?(t()) :: boolean()
  def enabled?(%__MODULE__{budget: b}), do: b > 0

  @doc "Bytes a copy may take when evicted caches are saved (0 = none)."
  @spec purge_save_bytes(t()) :: non_neg_integer()
  def purge_save_bytes(%__MODULE__{budget: b}), do: b

  @doc """
  The `{:save, seq, len, max_bytes, tag}` op that copies a slot's cache about to be lost, or
  `nil` when the cache is off, the prefix short or an entry already covers it.
  """
  @spec save_op(t(), non_neg_integer(), [non_neg_integer()], term()) :: {t(), tuple() | nil}
  def save_op(cache, seq, tokens, scope) do
    if enabled?(cache) and length(tokens) >= @min_tokens and not covers?(cache, tokens, scope),
      do: op(cache, seq, tokens, scope, nil, cache.budget),
      else: {cache, nil}
  end

  @doc "The save op of `Server.save_prefix/4`: its copy is answered to `from`, not kept."
  @spec reply_op(t(), non_neg_integer(), [non_neg_integer()], term(), GenServer.from()) ::
          {t(), tuple()}
  def reply_op(cache, seq, tokens, scope, from),
    do: op(cache, seq, tokens, scope, from, @unbounded)

  defp op(cache, seq, tokens, scope, reply, max_bytes) do
    tag = cache.next_tag

    {%{cache | next_tag: tag + 1, pending: Map.put(cache.pending, tag, {tokens, scope, reply})},
     {:save, seq, length(tokens), max_bytes, tag}}
  end

  @doc "Whether an entry of `scope` starts with all of `tokens`."
  @spec covers?(t(), [non_neg_integer()], term()) :: boolean()
  def covers?(cache, tokens, scope) do
    n = length(tokens)

    Enum.any?(cache.entries, fn e ->
      e.scope == scope and e.len >= n and prefix_length(e.tokens, tokens) == n
    end)
  end

  @doc """
  A copy the engine made: `{cache, event}` where event is `{:reply, from, copy}` for a
  `save_prefix` copy, `{:saved, entry, evicted}` when kept, `nil` when dropped. `fallback`
  gives the tokens and scope of an untagged copy (an evicted slot's cache).
  """
  def saved(cache, 0, {ref, bytes, len}, {tokens, scope}),
    do: keep(cache, Enum.take(tokens, len), scope, ref, bytes)

  def saved(cache, tag, {ref, bytes, len}, _fallback) do
    case Map.pop(cache.pending, tag) do
      {nil, _} ->
        {cache, nil}

      {{tokens, scope, nil}, pending} ->
        keep(%{cache | pending: pending}, Enum.take(tokens, len), scope, ref, bytes)

      {{tokens, scope, from}, pending} ->
        {%{cache | pending: pending}, {:reply, from, {Enum.take(tokens, len), scope, ref, bytes}}}
    end
  end

  @doc "Save ops of a finished step that produced no copy: `{cache, [from]}` to answer."
  @spec drop_pending(t(), [pos_integer()]) :: {t(), [GenServer.from()]}
  def drop_pending(cache, tags) do
    {dropped, pending} = Map.split(cache.pending, tags)
    waiting = for {_, {_, _, from}} <- dropped, from != nil, do: from
    {%{cache | pending: pending}, waiting}
  end

  @doc "Adds an entry loaded from disk (`Server.load_prefix/2`)."
  @spec load(t(), [non_neg_integer()], term(), reference(), non_neg_integer()) ::
          {:ok, t(), entry(), [entry()]} | {:error, term()}
  def load(cache, tokens, scope, ref, bytes) do
    cond do
      not enabled?(cache) -> {:error, :prompt_cache_disabled}
      bytes > cache.budget -> {:error, {:prompt_cache_too_small, bytes}}
      true -> {:ok, put(cache, tokens, scope, ref, bytes)} |> loaded()
    end
  end

  defp loaded({:ok, {cache, entry, evicted}}), do: {:ok, cache, entry, evicted}

  # a copy smaller than the minimum or already covered is dropped (the engine copied it
  # blind under pressure)
  defp keep(cache, tokens, scope, ref, bytes) do
    if length(tokens) < @min_tokens or bytes > cache.budget or covers?(cache, tokens, scope) do
      {cache, nil}
    else
      {cache, entry, evicted} = put(cache, tokens, scope, ref, bytes)
      {cache, {:saved, entry, evicted}}
    end
  end

  # the new entry replaces the entries it covers, then the oldest go until the budget holds
  defp put(cache, tokens, scope, ref, bytes) do
    entry = %{tokens: tokens, len: length(tokens), scope: scope, ref: ref, bytes: bytes}

    {covered, kept} =
      Enum.split_with(cache.entries, fn e ->
        e.scope == scope and e.len <= entry.len and prefix_length(e.tokens, tokens) == e.len
      end)

    cache = %{
      cache
      | entries: kept ++ [entry],
        bytes: cache.bytes - sum_bytes(covered) + bytes,
        saves: cache.saves + 1
    }

    {cache, evicted} = evict(cache, [])
    {cache, entry, covered ++ evicted}
  end

  defp evict(%{bytes: b, budget: budget} = cache, acc) when b <= budget, do: {cache, acc}

  defp evict(%{entries: [oldest | rest]} = cache, acc) do
    evict(
      %{cache | entries: rest, bytes: cache.bytes - oldest.bytes, evictions: cache.evictions + 1},
      [oldest | acc]
    )
  end

  @doc """
  The entry to restore for a prompt and how many of its tokens: the longest prefix of
  `tokens` an entry of `scope` holds (capped at `length(tokens) - 1`, so a token is always
  evaluated), when it is at least a quarter of the entry and `usable?.(entry_len, n)` (a
  sliding window kept what position n needs). `{nil, 0}` otherwise.
  """
  @spec best(
          t(),
          [non_neg_integer()],
          term(),
          (non_neg_integer(), non_neg_integer() ->
             boolean())
        ) ::
          {entry() | nil, non_neg_integer()}
  def best(%__MODULE__{entries: []}, _tokens, _scope, _usable?), do: {nil, 0}

  def best(cache, tokens, scope, usable?) do
    n = length(tokens)

    cache.entries
    |> Enum.filter(&(&1.scope == scope))
    |> Enum.map(fn e -> {e, min(prefix_length(e.tokens, tokens), n - 1)} end)
    |> Enum.filter(fn {e, l} -> l > 0 and l >= e.len * @min_share and usable?.(e.len, l) end)
    |> Enum.max_by(fn {_, l} -> l end, fn -> {nil, 0} end)
  end

  @doc "Counts a restore."
  @spec hit(t()) :: t()
  def hit(cache), do: %{cache | hits: cache.hits + 1}

  @doc "Counters for `get_stats/1`."
  @spec stats(t()) :: map()
  def stats(cache) do
    %{
      ram_cache_entries: length(cache.entries),
      ram_cache_bytes: cache.bytes,
      ram_cache_budget_bytes: cache.budget,
      ram_cache_hits: cache.hits,
      ram_cache_saves: cache.saves,
      ram_cache_evictions: cache.evictions
    }
  end

  @doc """
  Emits `[:llama_cpp_ex, :server, :ram_cache]` for an entry of `bytes` (`tokens` of it
  saved, restored or evicted), with the cache's totals after the operation.
  """
  @spec emit(t(), :save | :restore | :evict, non_neg_integer(), non_neg_integer()) :: :ok
  def emit(cache, op, bytes, tokens) do
    LlamaCppEx.Telemetry.execute(
      [:llama_cpp_ex, :server, :ram_cache],
      %{bytes: bytes, tokens: tokens, total_bytes: cache.bytes, entries: length(cache.entries)},
      %{server: self(), op: op}
    )
  end

  defp sum_bytes(entries), do: Enum.reduce(entries, 0, &(&1.bytes + &2))

  defp prefix_length(a, b), do: LlamaCppEx.Server.Placement.common_prefix_length(a, b)
end
