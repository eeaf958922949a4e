defmodule LlamaCppEx.Server.Placement do
  @moduledoc false
  # Where a queued request goes and what it reuses: the idle slot (session affinity, then the
  # longest cached prefix, then least recently used) and the longest prefix already in the
  # cache, its own slot's or any other slot's in the same cache scope (shared by blocks, never
  # re-evaluated), or in the level-2 RAM cache (copied back). A slot's cache about to be
  # overwritten is copied to the RAM cache first. Decisions become KV operations shipped with
  # the next step.

  alias LlamaCppEx.NIF
  alias LlamaCppEx.Server.{PromptCache, Request, Slot, State, Stats}
  require Logger

  @prefix_instability_min 64

  @doc """
  Places queued requests into idle slots while both exist (the server's state in and out);
  emits `request.start` (and `prefix_instability`) telemetry.
  """
  @spec dequeue(State.t()) :: State.t()
  def dequeue(st) do
    idle = Enum.filter(st.slots, fn {_, s} -> s.state == :idle end)

    if idle == [] or :queue.is_empty(st.queue) do
      st
    else
      {request, queue, seq} = next_request(st, idle)

      if fits?(st, request),
        do: st |> Map.put(:queue, queue) |> place(seq, request) |> dequeue(),
        else: st
    end
  end

  # Whether the KV cache can take the request's prompt now, by the engine's count (as of the
  # last step): what its free blocks hold plus what dropping the idle caches would free (the
  # blocks they alone hold), less what the active requests still need (the rest of each
  # prompt, one token per generating request). A request that does not fit waits in the queue
  # (taking a slot only to fail mid-prompt with :context_full would be worse); with no active
  # request nothing would free blocks, so it goes and the engine evicts idle caches for it.
  # The estimate ignores prefix sharing (the prompt counts whole), so it errs towards waiting.
  defp fits?(st, request) do
    active = for {_, s} <- st.slots, Slot.active?(s), do: s

    if active == [] do
      true
    else
      evictable = evictable_tokens(st)

      pending =
        Enum.reduce(active, 0, fn
          %Slot{state: :prefilling} = s, n -> n + s.n_prompt - s.prefill_pos
          %Slot{state: :generating}, n -> n + 1
        end)

      length(request.tokens) + 1 <= st.kv_free + evictable - pending
    end
  end

  @doc "KV tokens that dropping the idle slots' caches would free (the blocks they alone hold)."
  @spec evictable_tokens(State.t()) :: non_neg_integer()
  def evictable_tokens(st) do
    for {seq, s} <- st.slots, s.state == :idle, reduce: 0 do
      n -> n + Map.get(st.kv_exclusive, seq, 0)
    end
  end

  defp next_request(st, idle) do
    list = :queue.to_list(st.queue)

    by_session =
      Enum.find_value(list, fn r ->
        seq = session_slot_if_idle(st.sessions, Request.session_key(r), idle)
        if seq, do: {r, seq}
      end)

    case by_session do
      {r, seq} ->
        {r, :queue.from_list(List.delete(list, r)), seq}

      nil ->
        {{:value, r}, queue} = :queue.out(st.queue)
        {r, queue, acquire_slot(idle, r)}
    end
  end

  defp acquire_slot(idle, request) do
    case request.cache_prompt && pick_cached_slot(idle, request.tokens) do
      {seq, lcp} when lcp > 0 -> seq
      _ -> pick_lru_slot(idle)
    end
  end

  defp place(st, seq, %Request{} = r) do
    old = Map.fetch!(st.slots, seq)
    n = length(r.tokens)

    own =
      if r.cache_prompt and old.cache_scope == r.cache_scope,
        do: min(common_prefix_length(old.cached, r.tokens), n - 1),
        else: 0

    own = if prefix_usable?(length(old.cached), own, st.swa_window), do: own, else: 0

    {donor, donor_len} =
      if r.cache_prompt and st.config.kv_unified,
        do: best_donor(st, seq, r.cache_scope, r.tokens, n),
        else: {nil, 0}

    {entry, ram_len} =
      if r.cache_prompt,
        do:
          PromptCache.best(st.prompt_cache, r.tokens, r.cache_scope, fn len, l ->
            prefix_usable?(len, l, st.swa_window)
          end),
        else: {nil, 0}

    # ties go to the slot's own cache (nothing moves), then a donor's blocks (shared, not
    # copied), then the RAM cache (copied back)
    best = Enum.max([own, donor_len, ram_len])

    {source, match} =
      cond do
        own == best -> {:own, own}
        donor_len == best -> {:donor, donor_len}
        true -> {:ram, ram_len}
      end

    ops =
      case source do
        :own when length(old.cached) > own -> [{:trim, seq, own}]
        :own -> []
        :donor -> [{:share, donor, seq, donor_len}]
        :ram -> [{:restore, seq, entry.ref, ram_len}]
      end

    # what the slot held beyond what it keeps is copied to the RAM cache before it goes
    kept = if source == :own, do: own, else: 0

    {cache, save} =
      if length(old.cached) > kept,
        do: PromptCache.save_op(st.prompt_cache, seq, old.cached, old.cache_scope),
        else: {st.prompt_cache, nil}

    ops = if save, do: [save | ops], else: ops
    cache = if source == :ram, do: restored(cache, entry, match), else: cache
    st = %{st | prompt_cache: cache}

    warned = prefix_instability(st, seq, old, own, n)
    now = Stats.now_ms()
    r = %{r | t_start: now, n_prefix_cache: match}

    slot = %Slot{
      seq: seq,
      state: :prefilling,
      request: r,
      prompt: List.to_tuple(r.tokens),
      n_prompt: n,
      prefill_pos: match,
      pos: match,
      cache_scope: r.cache_scope,
      session: r.session,
      t_last_used: now
    }

    sessions =
      case Request.session_key(r) do
        nil -> st.sessions
        key -> Map.put(st.sessions, key, seq)
      end

    LlamaCppEx.Telemetry.execute(
      [:llama_cpp_ex, :server, :request, :start],
      %{prompt_tokens: n, prefix_cache_tokens: match},
      %{server: self(), seq_id: seq, mode: r.mode}
    )

    %{
      st
      | slots: Map.put(st.slots, seq, slot),
        sessions: sessions,
        pending_ops: st.pending_ops ++ ops,
        warned_instability: warned
    }
  end

  defp restored(cache, entry, tokens) do
    cache = PromptCache.hit(cache)
    PromptCache.emit(cache, :restore, entry.bytes, tokens)
    cache
  end

  defp best_donor(st, seq, scope, tokens, n) do
    st.slots
    |> Enum.reject(fn {s, slot} -> s == seq or slot.cache_scope != scope end)
    |> Enum.map(fn {s, slot} -> {s, min(donor_prefix_match(slot, tokens), n - 1)} end)
    |> Enum.filter(fn {s, len} ->
      len > 0 and prefix_usable?(Slot.fed_length(st.slots[s]), len, st.swa_window)
    end)
    |> Enum.max_by(fn {s, len} -> {len, -s} end, fn -> {nil, 0} end)
  end

  # A prompt that diverges early from a long cached conversation suggests a template that
  # rewrites earlier turns; a prompt that is itself a prefix of the cache (the same prompt sent
  # again, a shorter one) rewrote nothing. Logged once per server; telemetry every time.
  defp prefix_instability(st, seq, old, matched, prompt_len) do
    cached = length(old.cached)

    if cached >= @prefix_instability_min and matched * 10 >= cached and matched * 2 <= cached and
         matched < prompt_len - 1 do
      LlamaCppEx.Telemetry.execute(
        [:llama_cpp_ex, :server, :prefix_instability],
        %{matched_tokens: matched, cached_tokens: cached},
        %{server: self(), seq_id: seq}
      )

      unless st.warned_instability do
        Logger.warning(
          "LlamaCppEx.Server: a request matched only #{matched} of #{cached} cached tokens; " <>
            "a chat template may be rewriting earlier turns (logged once per server)"
        )
      end

      true
    else
      st.warned_instability
    end
  end

  # ------------------------------------------------------------ prefix matching

  @doc "Length of the common prefix of two token lists."
  @spec common_prefix_length([integer()], [integer()]) :: non_neg_integer()
  def common_prefix_length(a, b), do: lcp(a, b, 0)

  defp lcp([x | a], [x | b], n), do: lcp(a, b, n + 1)
  defp lcp(_, _, n), do: n

  @doc "The seq_id last used with `key` if that slot is idle."
  @spec session_slot_if_idle(map(), term(), [{non_neg_integer(), Slot.t()}]) ::
          non_neg_integer() | nil
  def session_slot_if_idle(_sessions, nil, _idle), do: nil

  def session_slot_if_idle(sessions, key, idle_slots) do
    with seq when is_integer(seq) <- Map.get(sessions, key),
         true <- Enum.any?(idle_slots, fn {s, _} -> s == seq end) do
      seq
    else
      _ -> nil
    end
  end

  @doc """
  The idle slot whose cached tokens share the longest prefix with `tokens`, as `{seq_id, lcp}`,
  when that prefix is more than 10% of the prompt; otherwise `{lru_seq_id, 0}`. `nil` when
  there are no idle slots.
  """
  @spec pick_cached_slot([{non_neg_integer(), Slot.t()}], [integer()]) ::
          {non_neg_integer(), non_neg_integer()} | nil
  def pick_cached_slot([], _tokens), do: nil

  def pick_cached_slot(idle_slots, []), do: {pick_lru_slot(idle_slots), 0}

  def pick_cached_slot(idle_slots, tokens) do
    n = length(tokens)

    {seq, best} =
      idle_slots
      |> Enum.map(fn {seq, slot} -> {seq, common_prefix_length(slot.cached, tokens)} end)
      |> Enum.max_by(fn {seq, l} -> {l, -seq} end)

    if best * 10 > n, do: {seq, best}, else: {pick_lru_slot(idle_slots), 0}
  end

  @doc "The idle slot used least recently."
  @spec pick_lru_slot([{non_neg_integer(), Slot.t()}]) :: non_neg_integer() | nil
  def pick_lru_slot([]), do: nil

  def pick_lru_slot(idle_slots) do
    {seq, _} = Enum.min_by(idle_slots, fn {seq, slot} -> {slot.t_last_used, seq} end)
    seq
  end

  @doc """
  How many leading tokens of `tokens` a slot's KV cache already holds: idle slots their
  cached tokens, prefilling slots the prompt tokens fed so far, generating slots the prompt
  plus the generated tokens fed so far.
  """
  @spec donor_prefix_match(Slot.t(), [integer()]) :: non_neg_integer()
  def donor_prefix_match(%Slot{state: :idle, cached: cached}, tokens),
    do: common_prefix_length(cached, tokens)

  def donor_prefix_match(%Slot{state: :prefilling} = slot, tokens),
    do: min(common_prefix_length(Tuple.to_list(slot.prompt), tokens), slot.prefill_pos)

  def donor_prefix_match(%Slot{state: :generating} = slot, tokens) do
    n_prompt = slot.n_prompt
    lcp = common_prefix_length(Tuple.to_list(slot.prompt), tokens)

    if lcp < n_prompt do
      lcp
    else
      rest = Enum.drop(tokens, n_prompt)
      min(n_prompt + common_prefix_length(Enum.reverse(slot.fed), rest), Slot.fed_length(slot))
    end
  end

  @doc """
  Whether the first `n` tokens of a sequence holding `len` tokens can be continued on a model
  whose sliding-window layers (window `window`, 0 = none) dropped old blocks: the engine's
  rule (`llama_cpp_ex_engine::kv::window_keeps_prefix`).
  """
  @spec prefix_usable?(non_neg_integer(), non_neg_integer(), non_neg_integer()) :: boolean()
  def prefix_usable?(_len, _n, 0), do: true
  def prefix_usable?(len, n, window), do: NIF.kv_prefix_usable(len, n, window)
end
