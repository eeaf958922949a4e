defmodule LlamaCppEx.Server.Placement do
  @moduledoc false
  # Where a queued request goes and what it reuses: the idle slot (session affinity, then the
  # longest cached prefix, then least recently used) and the longest prefix already in the
  # cache, its own slot's or any other slot's in the same cache scope (shared by blocks, never
  # re-evaluated), or in the level-2 RAM cache (copied back). A slot's cache about to be
  # overwritten is copied to the RAM cache first. Decisions become KV operations shipped with
  # the next step.

  alias LlamaCppEx.Server.{PromptCache, Request, Slot, Slots, Stats}
  require Logger

  @prefix_instability_min 64

  @doc """
  Places queued requests into idle slots while both exist (the server's state in and out);
  emits `request.start` (and `prefix_instability`) telemetry.
  """
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

  # Whether the KV cache can take the request's prompt now: what the free blocks hold (as of
  # the last step) plus the idle caches that may be evicted, less what the active requests
  # still need (the rest of each prompt, one token per generating request). A request that
  # does not fit waits in the queue (taking a slot only to fail mid-prompt with
  # :context_full would be worse); with no active request nothing would free blocks, so it
  # goes and the engine evicts idle caches for it. The estimate ignores prefix sharing (the
  # prompt counts whole), so it errs towards waiting.
  defp fits?(st, request) do
    active = for {_, s} <- st.slots, Slot.active?(s), do: s

    if active == [] do
      true
    else
      evictable =
        for {_, s} <- st.slots, s.state == :idle, reduce: 0, do: (n -> n + length(s.cached))

      pending =
        Enum.reduce(active, 0, fn
          %Slot{state: :prefilling} = s, n -> n + s.n_prompt - s.prefill_pos
          %Slot{state: :generating}, n -> n + 1
        end)

      length(request.tokens) + 1 <= st.kv_free + evictable - pending
    end
  end

  defp next_request(st, idle) do
    list = :queue.to_list(st.queue)

    by_session =
      Enum.find_value(list, fn r ->
        seq = Slots.session_slot_if_idle(st.sessions, Request.session_key(r), idle)
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
    case request.cache_prompt && Slots.pick_cached_slot(idle, request.tokens) do
      {seq, lcp} when lcp > 0 -> seq
      _ -> Slots.pick_lru_slot(idle)
    end
  end

  defp place(st, seq, %Request{} = r) do
    old = Map.fetch!(st.slots, seq)
    n = length(r.tokens)

    own =
      if r.cache_prompt and old.cache_scope == r.cache_scope,
        do: min(Slots.common_prefix_length(old.cached, r.tokens), n - 1),
        else: 0

    own = if Slots.prefix_usable?(length(old.cached), own, st.swa_window), do: own, else: 0

    {donor, donor_len} =
      if r.cache_prompt and st.config.kv_unified,
        do: best_donor(st, seq, r.cache_scope, r.tokens, n),
        else: {nil, 0}

    {entry, ram_len} =
      if r.cache_prompt,
        do:
          PromptCache.best(st.prompt_cache, r.tokens, r.cache_scope, fn len, l ->
            Slots.prefix_usable?(len, l, st.swa_window)
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
      %{server: self(), seq_id: seq, mode: :stream}
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
    |> Enum.map(fn {s, slot} -> {s, min(Slots.donor_prefix_match(slot, tokens), n - 1)} end)
    |> Enum.filter(fn {s, len} ->
      len > 0 and Slots.prefix_usable?(Slot.fed_length(st.slots[s]), len, st.swa_window)
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
end
