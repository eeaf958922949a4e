defmodule LlamaCppEx.Server.Tick do
  @moduledoc false
  # The server's cycle. A tick places queued requests into idle slots, asks the strategy for
  # a plan, and submits ONE step (the KV operations decided since the last one, then one
  # forward pass) to the engine thread; the GenServer keeps serving messages while it runs.
  # When the outcome arrives, each sampled token goes through its request's pipeline, the
  # events go to the request's consumer, and requests that ended free their slots. At most
  # one step is in flight.

  alias LlamaCppEx.{NIF, Pipeline, Telemetry}

  alias LlamaCppEx.Server.{
    EmbedJob,
    KvPolicy,
    PausePolicy,
    Placement,
    Plan,
    PromptCache,
    Request,
    Slot,
    Stats
  }

  require Logger

  @doc "Sends `:tick` unless one is pending or a step is in flight."
  def schedule(%{tick_scheduled: true} = st), do: st
  def schedule(%{in_flight: f} = st) when f != nil, do: st

  def schedule(st) do
    send(self(), :tick)
    %{st | tick_scheduled: true}
  end

  def has_work?(st) do
    Enum.any?(st.slots, fn {_, s} -> Slot.active?(s) end) or
      not :queue.is_empty(st.queue) or st.pending_ops != [] or embeds_waiting?(st)
  end

  defp embeds_waiting?(st), do: Enum.any?(st.embed_jobs, fn {_, j} -> j.todo != [] end)

  @doc "Texts of `embed/3` calls not yet placed in a step."
  def embed_texts_waiting(st),
    do: st.embed_jobs |> Map.values() |> Enum.map(&length(&1.todo)) |> Enum.sum()

  @doc "One tick: consult the pause level, place, plan, submit."
  def run(st) do
    st = %{st | tick_scheduled: false}

    if st.in_flight != nil or st.model == nil do
      st
    else
      st = update_pause(st)

      case st.pause_level do
        :full -> poll_pause(st)
        level -> st |> Placement.dequeue() |> submit(level) |> poll_pause()
      end
    end
  end

  @doc "Sets the level `LlamaCppEx.Server.pause/2` asked for and ticks."
  def set_manual_pause(st, level), do: schedule(%{st | pause_manual: level})

  # The stronger of the manual level and the policy's; changes are telemetry events, and
  # time in a full pause is left out of the throughput window.
  defp update_pause(st) do
    {policy_level, st} = policy_level(st)
    level = PausePolicy.max(st.pause_manual, policy_level)

    if level == st.pause_level do
      st
    else
      Telemetry.execute(
        [:llama_cpp_ex, :server, :pause],
        %{},
        %{server: self(), level: level, previous: st.pause_level, manual: st.pause_manual}
      )

      %{st | pause_level: level, stats: Stats.paused(st.stats, level == :full)}
    end
  end

  defp policy_level(%{config: %{pause_policy: nil}} = st), do: {:none, st}

  defp policy_level(st) do
    {mod, arg} =
      case st.config.pause_policy do
        {mod, arg} -> {mod, arg}
        mod -> {mod, []}
      end

    info = %{
      active_slots: Enum.count(st.slots, fn {_, s} -> Slot.active?(s) end),
      queue_depth: :queue.len(st.queue),
      embed_queue_depth: embed_texts_waiting(st),
      tick: st.tick,
      manual: st.pause_manual
    }

    level =
      try do
        mod.pause_level(info, arg)
      catch
        kind, reason -> {:invalid, {kind, reason}}
      end

    if level in PausePolicy.levels() do
      {level, st}
    else
      unless st.policy_warned do
        Logger.warning(
          "LlamaCppEx.Server: pause policy #{inspect(mod)} returned #{inspect(level, limit: 5)}; " <>
            "running as :none (logged once per server)"
        )
      end

      {:none, %{st | policy_warned: true}}
    end
  end

  # While paused with work waiting and a policy to ask again, the next tick comes by timer
  # (a manual pause ends with resume/1, which ticks).
  defp poll_pause(%{pause_level: :none} = st), do: st

  defp poll_pause(st) do
    if st.config.pause_policy != nil and st.in_flight == nil and not st.tick_scheduled and
         has_work?(st) do
      Process.send_after(self(), :tick, st.config.pause_poll_ms)
      %{st | tick_scheduled: true}
    else
      st
    end
  end

  defp submit(st, level) do
    cfg = st.config
    opts = [queue_depth: :queue.len(st.queue), tick: st.tick]
    share = if level == :prefill, do: 0, else: embed_share(st)
    budget = strategy_budget(st, share)
    plan = cfg.batch_strategy.build_batch(st.slots, budget, cfg.chunk_size, opts)
    plan = Plan.validate!(plan, st.slots, budget, cfg.chunk_size, cfg.batch_strategy)
    # paused prefill: only the decode rows of requests already generating
    plan = if level == :prefill, do: Enum.filter(plan, &match?({:decode, _}, &1)), else: plan
    {entries, slots, samplers, counts} = Plan.to_step(plan, st.slots)
    {specs, counts} = Map.pop(counts, :specs)
    left = min(share, cfg.n_batch - counts.decode - counts.prefill)
    {st, embed_entries, embeds} = place_embeds(st, left)

    if entries == [] and embed_entries == [] and st.pending_ops == [] do
      st
    else
      purgeable =
        slots
        |> Enum.filter(fn {_, s} -> s.state == :idle and s.cached != [] end)
        |> Enum.sort_by(fn {seq, s} -> {s.t_last_used, seq} end)
        |> Enum.map(&elem(&1, 0))

      ref = make_ref()

      wire_embeds =
        Enum.map(embeds, fn {seq, _ref, _i, pooling, norm} -> {seq, pooling, norm} end)

      :ok =
        NIF.engine_submit(
          st.engine,
          self(),
          ref,
          {st.pending_ops, entries ++ embed_entries, samplers,
           {purgeable, PromptCache.purge_save_bytes(st.prompt_cache)}, wire_embeds, specs}
        )

      flight =
        counts
        |> Map.put(:ref, ref)
        |> Map.put(:save_tags, for({:save, _, _, _, tag} <- st.pending_ops, do: tag))
        |> Map.put(:embed, length(embed_entries))
        |> Map.put(:embeds, Map.new(embeds, fn {seq, r, i, _, _} -> {seq, {r, i}} end))

      %{st | slots: slots, pending_ops: [], tick: st.tick + 1, in_flight: flight}
    end
  end

  # What waiting embedding texts may take of a pass: while requests generate, `:embed_chunk`
  # tokens (their decode rows wait for the whole pass, so this bounds the inter-token
  # latency embeddings add), else half the batch; always the first waiting text whole.
  defp embed_share(st) do
    case Enum.find_value(st.embed_order, &waiting_job(st, &1)) do
      nil ->
        0

      job ->
        [{first, _} | _] = job.todo
        decoding = Enum.any?(st.slots, fn {_, s} -> s.state == :generating end)
        share = if decoding, do: st.config.embed_chunk, else: div(st.config.n_batch, 2)

        waiting = st.embed_jobs |> Map.values() |> Enum.map(& &1.waiting) |> Enum.sum()

        min(waiting, max(share, length(first)))
    end
  end

  # The strategy plans what the embedding share leaves; generating slots always keep their
  # one decode row each.
  defp strategy_budget(st, share) do
    decoding = Enum.count(st.slots, fn {_, s} -> s.state == :generating end)
    min(max(st.config.n_batch - share, decoding), st.config.n_batch)
  end

  defp waiting_job(st, ref) do
    case Map.fetch(st.embed_jobs, ref) do
      {:ok, %EmbedJob{todo: [_ | _]} = job} -> job
      _ -> nil
    end
  end

  # Whole texts of the waiting jobs, first come first served, into the tokens `left` and the
  # free embedding sequences: `{st, entries, [{seq, job_ref, index, pooling, normalize}]}`.
  defp place_embeds(%{embed_order: []} = st, _left), do: {st, [], []}

  defp place_embeds(st, left) do
    {jobs, placed, _left, free} =
      Enum.reduce_while(st.embed_order, {st.embed_jobs, [], left, st.embed_free}, fn
        ref, {jobs, placed, left, free} ->
          job = Map.fetch!(jobs, ref)
          {job, taken, left, free} = EmbedJob.take(job, left, free)
          placed = placed ++ Enum.map(taken, &{&1, job})
          acc = {Map.put(jobs, ref, job), placed, left, free}
          # a job whose next text does not fit holds the ones behind it (first come first served)
          if job.todo == [], do: {:cont, acc}, else: {:halt, acc}
      end)

    entries =
      Enum.flat_map(placed, fn {{seq, _i, ids}, _job} ->
        ids |> Enum.with_index() |> Enum.map(fn {tok, pos} -> {tok, pos, seq, false} end)
      end)

    embeds =
      Enum.map(placed, fn {{seq, i, _ids}, job} ->
        {seq, job.ref, i, job.pooling, job.normalize}
      end)

    {%{st | embed_jobs: jobs, embed_free: free}, entries, embeds}
  end

  @doc "Applies a step's outcome."
  def apply_outcome(
        st,
        {sampled, purged, n_splits, failed, eval_us, embedded,
         {kv_free, occupancy, drafted, saved, restore_failed}}
      ) do
    flight = st.in_flight

    st = %{
      st
      | in_flight: nil,
        embed_free: Map.keys(flight.embeds) ++ st.embed_free,
        kv_free: kv_free
    }

    st = apply_kv_policy(st, occupancy)

    # copies first: an evicted slot's copy is known by the tokens the slot still lists
    st = Enum.reduce(saved, st, &keep_copy/2)
    st = drop_saves(st, flight.save_tags)
    st = Enum.reduce(restore_failed, st, &restore_failed/2)

    {failed_embeds, failed} = Enum.split_with(failed, &Map.has_key?(flight.embeds, &1))
    st = Enum.reduce(failed_embeds, st, &fail_embed(&2, flight.embeds[&1], :context_full))
    st = Enum.reduce(embedded, st, &apply_embedding(&2, flight.embeds, &1))

    st = %{
      st
      | slots:
          Enum.reduce(purged, st.slots, fn seq, slots ->
            Map.update!(slots, seq, &%{&1 | cached: []})
          end)
    }

    st = Enum.reduce(failed, st, &fail(&2, &1, :context_full))
    st = Enum.reduce(drafted, st, &count_drafts/2)
    st = Enum.reduce(sampled, st, &apply_sample/2)

    if purged != [] or n_splits > 0 do
      Telemetry.execute(
        [:llama_cpp_ex, :server, :kv_pressure],
        %{purged_slots: length(purged), batch_splits: n_splits},
        %{server: self(), purged_seq_ids: purged}
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
        eval_ms: eval_us / 1000
      },
      %{server: self()}
    )

    if has_work?(st), do: schedule(st), else: st
  end

  # The precision policy sees every step's occupancy; a new level reaches the engine as an op
  # of the next step (blocks allocated from then on take it).
  defp apply_kv_policy(%{kv_policy: nil} = st, _occupancy), do: st

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

  @doc "A failed step fails every active request and every embedding call it carried."
  def apply_error(st, reason) do
    embeds = st.in_flight.embeds
    st = drop_saves(st, st.in_flight.save_tags)
    st = %{st | in_flight: nil, embed_free: Map.keys(embeds) ++ st.embed_free}

    st =
      embeds
      |> Map.values()
      |> Enum.reduce(st, &fail_embed(&2, &1, {:inference_failed, reason}))

    st =
      st.slots
      |> Enum.filter(fn {_, s} -> Slot.active?(s) end)
      |> Enum.reduce(st, fn {seq, _}, st -> fail(st, seq, {:inference_failed, reason}) end)

    if has_work?(st), do: schedule(st), else: st
  end

  # A text's vector; the call it belongs to may have ended meanwhile (cancelled, failed).
  defp apply_embedding(st, placed, {seq, result}) do
    {ref, i} = Map.fetch!(placed, seq)

    case {Map.fetch(st.embed_jobs, ref), result} do
      {:error, _} ->
        st

      {{:ok, job}, {:ok, bin}} ->
        case EmbedJob.put(job, i, bin) do
          {:cont, job} ->
            %{st | embed_jobs: Map.put(st.embed_jobs, ref, job)}

          {:done, job} ->
            EmbedJob.reply(job, self())
            st |> drop_embed(ref) |> Map.update!(:stats, &Stats.embeddings_done(&1, job.n_texts))
        end

      {{:ok, _job}, {:error, message}} ->
        fail_embed(st, {ref, i}, message)
    end
  end

  defp fail_embed(st, {ref, _i}, reason) do
    case Map.fetch(st.embed_jobs, ref) do
      {:ok, job} ->
        EmbedJob.fail(job, reason, self())
        drop_embed(st, ref)

      :error ->
        st
    end
  end

  defp drop_embed(st, ref) do
    case Map.pop(st.embed_jobs, ref) do
      {nil, _} ->
        st

      {job, jobs} ->
        if job.monitor_ref, do: Process.demonitor(job.monitor_ref, [:flush])
        %{st | embed_jobs: jobs, embed_order: List.delete(st.embed_order, ref)}
    end
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

  defp apply_sample({seq, token, piece, eog, logprobs}, st) do
    case Map.fetch!(st.slots, seq) do
      # the request ended while this step ran (cancelled), or earlier in this outcome
      %Slot{request: nil} ->
        st

      slot ->
        now = Stats.now_ms()

        slot =
          case slot.state do
            :prefilling ->
              %{
                slot
                | state: :generating,
                  pos: slot.n_prompt,
                  request: %{slot.request | t_first_token: now}
              }

            # a token sampled earlier in this outcome was an accepted draft token: it is in
            # the cache already
            :generating when slot.pending != nil ->
              r = slot.request

              %{
                slot
                | pos: slot.pos + 1,
                  fed: [slot.pending | slot.fed],
                  pending: nil,
                  request: %{r | n_accepted: r.n_accepted + 1}
              }

            :generating ->
              %{slot | pos: slot.pos + 1}
          end

        r = slot.request

        case Pipeline.push(r.pipeline, piece, eog, logprobs) do
          {:cont, events, p} ->
            Request.deliver(r, events)
            slot = %{slot | pending: token, request: %{r | pipeline: p}}
            %{st | slots: Map.put(st.slots, seq, slot)}

          {:done, events, p} ->
            {events, [{:done, reason}]} = Enum.split(events, -1)
            r = %{r | pipeline: p}
            Request.deliver(r, events)
            finish(%{st | slots: Map.put(st.slots, seq, %{slot | request: r})}, seq, reason)
        end
    end
  end

  @doc """
  Ends the request of slot `seq` normally (`:eog`, `:max_tokens`, `:stop`) or on `:cancelled`
  (nothing more is sent to its consumer).
  """
  def finish(st, seq, reason) do
    slot = Map.fetch!(st.slots, seq)
    r = slot.request

    if reason != :cancelled do
      Request.deliver(r, [{:usage, usage(slot)}, {:done, reason}])
    end

    Telemetry.execute(
      [:llama_cpp_ex, :server, :request, :done],
      Stats.done_measurements(slot, Stats.now_ms()),
      %{server: self(), seq_id: seq, mode: :stream, stop_reason: reason}
    )

    release(%{st | stats: Stats.request_done(st.stats, r)}, slot)
  end

  defp usage(slot),
    do: %{prompt_tokens: slot.n_prompt, completion_tokens: slot.request.pipeline.generated}

  @doc "Ends the request of slot `seq` with an error; its cache is dropped."
  def fail(st, seq, reason) do
    case Map.fetch!(st.slots, seq) do
      # a request cancelled while its tokens were in flight: the cache is no longer reliable
      %Slot{request: nil} ->
        clear_cache(st, seq)

      slot ->
        Request.deliver(slot.request, Pipeline.fail(slot.request.pipeline, reason))

        Telemetry.execute(
          [:llama_cpp_ex, :server, :request, :exception],
          Stats.done_measurements(slot, Stats.now_ms()),
          %{server: self(), seq_id: seq, mode: :stream, stop_reason: :error, reason: reason}
        )

        st |> release(slot) |> clear_cache(seq)
    end
  end

  defp release(st, %Slot{seq: seq, request: r} = slot) do
    if r.monitor_ref, do: Process.demonitor(r.monitor_ref, [:flush])

    # a speculating request that ended inside a verified draft leaves accepted draft tokens
    # past what it fed in the cache: cut them, so the cache is what the slot says it holds
    ops =
      cond do
        not r.cache_prompt -> st.pending_ops ++ [{:clear, seq}]
        r.n_draft != nil -> st.pending_ops ++ [{:trim, seq, Slot.fed_length(slot)}]
        true -> st.pending_ops
      end

    %{st | slots: Map.put(st.slots, seq, Slot.release(slot, Stats.now_ms())), pending_ops: ops}
  end

  defp clear_cache(st, seq) do
    slots = Map.update!(st.slots, seq, &%{&1 | cached: []})
    %{st | slots: slots, pending_ops: st.pending_ops ++ [{:clear, seq}]}
  end

  @doc "Cancels the request streaming to `ref` (active or queued) or the embedding call `ref`."
  def cancel(st, ref) do
    case Enum.find(st.slots, fn {_, s} -> s.request && s.request.stream_ref == ref end) do
      {seq, _} ->
        st |> finish(seq, :cancelled) |> schedule()

      nil ->
        st |> drop_queued(&(&1.stream_ref == ref)) |> drop_embed(ref)
    end
  end

  @doc "The consumer behind monitor `mref` died: its requests go."
  def consumer_down(st, mref) do
    st =
      st.slots
      |> Enum.filter(fn {_, s} -> s.request && s.request.monitor_ref == mref end)
      |> Enum.reduce(st, fn {seq, _}, st -> finish(st, seq, :cancelled) end)

    embeds = for {ref, j} <- st.embed_jobs, j.monitor_ref == mref, do: ref
    st = Enum.reduce(embeds, st, &drop_embed(&2, &1))
    st |> drop_queued(&(&1.monitor_ref == mref)) |> schedule()
  end

  defp drop_queued(st, pred) do
    {dropped, kept} = st.queue |> :queue.to_list() |> Enum.split_with(pred)

    Enum.each(dropped, fn r ->
      if r.monitor_ref, do: Process.demonitor(r.monitor_ref, [:flush])
    end)

    %{st | queue: :queue.from_list(kept)}
  end
end
