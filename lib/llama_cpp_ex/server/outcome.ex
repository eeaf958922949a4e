defmodule LlamaCppEx.Server.Outcome do
  @moduledoc false
  # What the server does with a step's outcome (`LlamaCppEx.Engine.Outcome`): the KV
  # figures admission and the precision policy read, the copies the engine made for the RAM
  # prompt cache, the embeddings, then each sampled token through its request's pipeline to
  # its consumer; requests that ended or failed free their slots.

  alias LlamaCppEx.Engine.{Outcome, Sampled}
  alias LlamaCppEx.{Pipeline, Telemetry}
  alias LlamaCppEx.Server.{Embeds, KvPolicy, Lifecycle, PromptCache, Request, Slot, State, Stats}

  @doc "Applies the outcome of the step in flight."
  @spec apply(State.t(), Outcome.t()) :: State.t()
  def apply(st, %Outcome{} = o) do
    flight = st.in_flight

    st = %{
      st
      | embed_free: Map.keys(flight.embeds) ++ st.embed_free,
        kv_free: o.kv_free_tokens,
        kv_exclusive: Map.new(o.kv_exclusive_tokens)
    }

    st = apply_kv_policy(st, o.kv_occupancy)

    # copies first: an evicted slot's copy is known by the tokens the slot still lists
    st = Enum.reduce(o.saved, st, &keep_copy/2)
    st = drop_saves(st, flight.save_tags)
    st = Enum.reduce(o.restore_failed, st, &restore_failed/2)

    {failed_embeds, failed} = Enum.split_with(o.failed, &Map.has_key?(flight.embeds, &1))
    st = Enum.reduce(failed_embeds, st, &Embeds.fail(&2, flight.embeds[&1], :context_full))
    st = Enum.reduce(o.embeddings, st, &Embeds.apply(&2, flight.embeds, &1))

    slots =
      Enum.reduce(o.purged, st.slots, fn seq, slots ->
        Map.update!(slots, seq, &%{&1 | cached: []})
      end)

    st = Enum.reduce(failed, %{st | slots: slots}, &Lifecycle.fail(&2, &1, :context_full))
    st = Enum.reduce(o.drafted, st, &count_drafts/2)
    st = Enum.reduce(o.sampled, st, &apply_sample/2)

    if o.purged != [] or o.n_splits > 0 do
      Telemetry.execute(
        [:llama_cpp_ex, :server, :kv_pressure],
        %{purged_slots: length(o.purged), batch_splits: o.n_splits},
        %{server: self(), purged_seq_ids: o.purged}
      )
    end

    Telemetry.execute(
      [:llama_cpp_ex, :server, :tick],
      %{
        batch_size: flight.decode + flight.prefill + flight.embed,
        decode_tokens: flight.decode,
        prefill_tokens: flight.prefill,
        embed_tokens: flight.embed,
        active_slots: Enum.count(st.slots, fn {_, s} -> Slot.active?(s) end),
        queue_depth: :queue.len(st.queue),
        eval_ms: o.eval_us / 1000
      },
      %{server: self(), queued: flight.queued}
    )

    st
  end

  @doc "A failed step fails every active request and every embedding call it carried."
  @spec apply_error(State.t(), term()) :: State.t()
  def apply_error(st, reason) do
    embeds = st.in_flight.embeds
    st = drop_saves(st, st.in_flight.save_tags)
    st = %{st | embed_free: Map.keys(embeds) ++ st.embed_free}

    st =
      embeds
      |> Map.values()
      |> Enum.reduce(st, &Embeds.fail(&2, &1, {:inference_failed, reason}))

    st.slots
    |> Enum.filter(fn {_, s} -> Slot.active?(s) end)
    |> Enum.reduce(st, fn {seq, _}, st ->
      Lifecycle.fail(st, seq, {:inference_failed, reason})
    end)
  end

  # The precision policy sees every step's occupancy; a new level reaches the engine as an op
  # of the next step (blocks allocated from then on take it).
  defp apply_kv_policy(%State{kv_policy: nil} = st, _occupancy), do: st

  defp apply_kv_policy(st, occupancy) do
    case KvPolicy.update(st.kv_policy, occupancy) do
      {policy, nil} ->
        %{st | kv_policy: policy}

      {policy, {from, to}} ->
        Telemetry.execute(
          [:llama_cpp_ex, :server, :kv_precision],
          %{occupancy: occupancy, ewma: policy.ewma},
          %{server: self(), from: from, to: to}
        )

        %{
          st
          | kv_policy: policy,
            pending_ops: st.pending_ops ++ [{:set_write_tier, KvPolicy.tier(policy)}]
        }
    end
  end

  # A copy the engine made (a save op's or an evicted cache's) goes to the RAM cache or to
  # the save_prefix/4 call waiting for it.
  defp keep_copy({seq, tag, copy}, st) do
    slot = Map.fetch!(st.slots, seq)

    {cache, event} =
      PromptCache.saved(st.prompt_cache, tag, copy, {slot.cached, slot.cache_scope})

    case event do
      nil ->
        :ok

      {:reply, from, prefix} ->
        GenServer.reply(from, {:ok, prefix})

      {:saved, entry, evicted} ->
        PromptCache.emit(cache, :save, entry.bytes, entry.len)
        Enum.each(evicted, &PromptCache.emit(cache, :evict, &1.bytes, &1.len))
    end

    %{st | prompt_cache: cache}
  end

  # save ops of the step that brought no copy (the sequence was shorter, the copy too big)
  defp drop_saves(st, tags) do
    {cache, waiting} = PromptCache.drop_pending(st.prompt_cache, tags)
    Enum.each(waiting, &GenServer.reply(&1, {:error, :not_cached}))
    %{st | prompt_cache: cache}
  end

  # A restore the cache could not take: the sequence is empty and its rows were not
  # evaluated, so the request evaluates its whole prompt instead.
  defp restore_failed(seq, st) do
    slot =
      case Map.fetch!(st.slots, seq) do
        %Slot{request: nil} = slot ->
          %{slot | cached: []}

        %Slot{request: r} = slot ->
          %{slot | prefill_pos: 0, pos: 0, request: %{r | n_prefix_cache: 0}}
      end

    %{st | slots: Map.put(st.slots, seq, slot)}
  end

  defp count_drafts({seq, n}, st) do
    case Map.fetch!(st.slots, seq) do
      %Slot{request: nil} ->
        st

      %Slot{request: r} = slot ->
        slot = %{slot | request: %{r | n_drafted: r.n_drafted + n}}
        %{st | slots: Map.put(st.slots, seq, slot)}
    end
  end

  defp apply_sample(%Sampled{seq: seq} = t, st) do
    case Map.fetch!(st.slots, seq) do
      # the request ended while this step ran (cancelled), or earlier in this outcome
      %Slot{request: nil} ->
        st

      slot ->
        slot = advance(slot, Stats.now_ms())
        r = slot.request

        case Pipeline.push(r.pipeline, t.piece, t.eog, t.logprobs) do
          {:cont, events, p} ->
            Request.deliver(r, events)
            slot = %{fed(slot, t.token) | request: %{r | pipeline: p}}
            %{st | slots: Map.put(st.slots, seq, slot)}

          {:done, events, p} ->
            {events, [{:done, reason}]} = Enum.split(events, -1)
            r = %{r | pipeline: p}
            Request.deliver(r, events)
            slots = Map.put(st.slots, seq, %{slot | request: r})
            Lifecycle.finish(%{st | slots: slots}, seq, reason)
        end
    end
  end

  # a token a queued step feeds already, or the one the next tick feeds
  defp fed(%Slot{chained: true} = slot, token),
    do: %{slot | fed: [token | slot.fed], chained: false}

  defp fed(slot, token), do: %{slot | pending: token}

  # the slot as a token sampled for it finds it
  defp advance(%Slot{state: :prefilling} = slot, now) do
    %{
      slot
      | state: :generating,
        pos: slot.n_prompt,
        request: %{slot.request | t_first_token: now}
    }
  end

  # a token sampled earlier in this outcome was an accepted draft token: it is in the cache
  # already
  defp advance(%Slot{state: :generating, pending: pending} = slot, _now) when pending != nil do
    r = slot.request

    %{
      slot
      | pos: slot.pos + 1,
        fed: [pending | slot.fed],
        pending: nil,
        request: %{r | n_accepted: r.n_accepted + 1}
    }
  end

  defp advance(%Slot{state: :generating} = slot, _now), do: %{slot | pos: slot.pos + 1}
end
