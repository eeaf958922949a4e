defmodule LlamaCppEx.Server.Tick do
  @moduledoc false
  # The server's cycle. A tick (after the pause level is asked) places queued requests into
  # idle slots, asks the strategy for a plan, adds waiting embedding texts, and submits ONE
  # step (the KV operations decided since the last one, then one forward pass) to the engine
  # thread; the GenServer keeps serving messages while it runs. Its outcome is applied by
  # `LlamaCppEx.Server.Outcome`, and the next tick follows while there is work.
  #
  # With `:overlap`, while every active request is generating and nothing else waits, the
  # next decode step is queued behind the one in flight without waiting for its outcome: its
  # rows feed the tokens that step samples, taken by the engine (`Step.follow`). The engine
  # then goes from one step to the next without waiting for the server's turn (the outcome's
  # trip to this process, its application, planning, the submit, the engine thread's wake),
  # which runs meanwhile. At most two steps are in flight, the second such a decode step. A
  # request that ends on a token its queued row then feeds costs that row; the row of a
  # request that reached `max_tokens` is never queued, and an end-of-generation token is
  # never fed.

  alias LlamaCppEx.Engine
  alias LlamaCppEx.Engine.Step
  alias LlamaCppEx.Server.{Embeds, Lifecycle, Outcome, Pause, Placement, Plan, PromptCache}
  alias LlamaCppEx.Server.{Config, Slot, State}
  alias LlamaCppEx.Server.Strategy.DecodeMaximal

  require Logger

  @doc "Sends `:tick` unless one is pending or a step is in flight."
  @spec schedule(State.t()) :: State.t()
  def schedule(%State{tick_scheduled: true} = st), do: st
  def schedule(%State{in_flight: f} = st) when f != nil, do: st

  def schedule(st) do
    send(self(), :tick)
    %{st | tick_scheduled: true}
  end

  @doc "Whether anything waits for a step: active slots, queued requests, ops, embeddings."
  @spec has_work?(State.t()) :: boolean()
  def has_work?(st) do
    Enum.any?(st.slots, fn {_, s} -> Slot.active?(s) end) or
      not :queue.is_empty(st.queue) or st.pending_ops != [] or Embeds.waiting?(st)
  end

  @doc "One tick: consult the pause level, place, plan, submit."
  @spec run(State.t()) :: State.t()
  def run(st) do
    st = %{st | tick_scheduled: false}

    if st.in_flight != nil or st.model == nil do
      st
    else
      st = Pause.update(st)

      case st.pause_level do
        :full -> Pause.poll(st, &has_work?/1)
        level -> st |> Placement.dequeue() |> submit(level) |> Pause.poll(&has_work?/1)
      end
    end
  end

  @doc "Sets the level `LlamaCppEx.Server.pause/2` asked for and ticks."
  @spec set_manual_pause(State.t(), :none | :prefill | :full) :: State.t()
  def set_manual_pause(st, level), do: schedule(%{st | pause_manual: level})

  @doc """
  Applies the outcome of the step in flight (the queued one, if any, is in flight next),
  then queues or ticks again while there is work.
  """
  @spec apply_outcome(State.t(), Engine.Outcome.t()) :: State.t()
  def apply_outcome(st, outcome),
    do: st |> Outcome.apply(outcome) |> promote() |> chain() |> continue()

  @doc "Fails what the step in flight carried, then ticks again while there is work."
  @spec apply_error(State.t(), term()) :: State.t()
  def apply_error(st, reason), do: st |> Outcome.apply_error(reason) |> promote() |> continue()

  @doc "Cancels the request or embedding call `ref`."
  @spec cancel(State.t(), reference()) :: State.t()
  def cancel(st, ref), do: st |> Lifecycle.cancel(ref) |> schedule()

  @doc "The consumer behind monitor `mref` died."
  @spec consumer_down(State.t(), reference()) :: State.t()
  def consumer_down(st, mref), do: st |> Lifecycle.consumer_down(mref) |> schedule()

  defp continue(st), do: if(has_work?(st), do: schedule(st), else: st)

  defp promote(st), do: %{st | in_flight: st.chained, chained: nil}

  # Queues the decode step that follows the newest one in flight, when that one had only
  # decode rows, every active request is generating (without speculation) and among them,
  # and nothing waits for a planned tick.
  defp chain(%State{chained: nil, in_flight: %{rows: [_ | _] = rows}} = st) do
    if Config.overlap?(st.config) and quiet?(st) do
      active = Enum.filter(st.slots, fn {_, s} -> Slot.active?(s) end)

      follow =
        if Enum.all?(active, fn {seq, s} -> follows?(s) and seq in rows end),
          do:
            for(
              {seq, s} <- active,
              s.request.pipeline.generated + 1 < s.request.max_tokens,
              do: seq
            ),
          else: []

      if follow == [], do: st, else: submit_follow(st, follow)
    else
      st
    end
  end

  defp chain(st), do: st

  defp follows?(%Slot{state: :generating, pending: nil, request: %{n_draft: nil}}), do: true
  defp follows?(_), do: false

  defp quiet?(st) do
    :queue.is_empty(st.queue) and st.pending_ops == [] and st.pause_level == :none and
      st.pause_manual == :none and st.pause_waiters == [] and st.audits == [] and
      not Embeds.waiting?(st)
  end

  # each row at the position after the row in flight, its token a placeholder
  defp submit_follow(st, seqs) do
    {entries, samplers, slots} =
      Enum.reduce(Enum.reverse(seqs), {[], [], st.slots}, fn seq, {es, ss, slots} ->
        s = Map.fetch!(slots, seq)

        {[{0, s.pos + 1, seq, true} | es], [{seq, s.request.sampler.ref} | ss],
         Map.put(slots, seq, %{s | chained: true})}
      end)

    step = %Step{
      entries: entries,
      samplers: samplers,
      follow: seqs,
      purgeable: purgeable(slots),
      save_purged_max_bytes: PromptCache.purge_save_bytes(st.prompt_cache)
    }

    ref = make_ref()
    :ok = Engine.submit(st.engine, ref, step)

    flight = %{
      ref: ref,
      queued: true,
      decode: length(seqs),
      prefill: 0,
      rows: seqs,
      save_tags: [],
      embed: 0,
      embeds: %{}
    }

    %{st | slots: slots, tick: st.tick + 1, chained: flight}
  end

  # idle caches a step may drop under KV pressure, least recently used first
  defp purgeable(slots) do
    slots
    |> Enum.filter(fn {_, s} -> s.state == :idle and s.cached != [] end)
    |> Enum.sort_by(fn {seq, s} -> {s.t_last_used, seq} end)
    |> Enum.map(&elem(&1, 0))
  end

  defp submit(st, level) do
    cfg = st.config
    opts = [queue_depth: :queue.len(st.queue), tick: st.tick]
    share = if level == :prefill, do: 0, else: Embeds.share(st)
    budget = strategy_budget(st, share)
    {st, plan} = plan(st, budget, opts)
    # paused prefill: only the decode rows of requests already generating
    plan = if level == :prefill, do: Enum.filter(plan, &match?({:decode, _}, &1)), else: plan
    {step, slots, counts} = Plan.to_step(plan, st.slots)
    left = min(share, cfg.n_batch - counts.decode - counts.prefill)
    {st, embed_entries, embeds, placed} = Embeds.place(st, left)

    if step.entries == [] and embed_entries == [] and st.pending_ops == [] do
      st
    else
      step = %Step{
        step
        | ops: st.pending_ops,
          entries: step.entries ++ embed_entries,
          purgeable: purgeable(slots),
          save_purged_max_bytes: PromptCache.purge_save_bytes(st.prompt_cache),
          embeds: embeds
      }

      ref = make_ref()
      :ok = Engine.submit(st.engine, ref, step)

      decode_only? = counts.prefill == 0 and embed_entries == [] and step.specs == []

      flight = %{
        ref: ref,
        queued: false,
        decode: counts.decode,
        prefill: counts.prefill,
        rows: if(decode_only?, do: for({_, _, seq, _} <- step.entries, do: seq), else: []),
        save_tags: for({:save, _, _, _, tag} <- st.pending_ops, do: tag),
        embed: length(embed_entries),
        embeds: placed
      }

      chain(%{st | slots: slots, pending_ops: [], tick: st.tick + 1, in_flight: flight})
    end
  end

  # The configured strategy's plan; a strategy that fails is replaced by the default for this
  # tick (logged once, telemetry each time), so one bad module fails no request.
  defp plan(%State{config: cfg} = st, budget, opts) do
    {st, Plan.of(cfg.batch_strategy, st.slots, budget, cfg.chunk_size, opts, st.model.ref)}
  catch
    kind, reason ->
      reason = Exception.normalize(kind, reason, __STACKTRACE__)
      meta = %{server: self(), strategy: cfg.batch_strategy, kind: kind, reason: reason}

      LlamaCppEx.Telemetry.execute(
        [:llama_cpp_ex, :server, :strategy, :exception],
        %{count: 1},
        meta
      )

      unless st.strategy_warned do
        Logger.error(
          "batch strategy #{inspect(cfg.batch_strategy)} failed; ticks use DecodeMaximal " <>
            "until it succeeds: " <> Exception.format(kind, reason, __STACKTRACE__)
        )
      end

      fallback = Plan.of(DecodeMaximal, st.slots, budget, cfg.chunk_size, opts, st.model.ref)
      {%{st | strategy_warned: true}, fallback}
  end

  # The strategy plans what the embedding share leaves; generating slots always keep their
  # one decode row each.
  defp strategy_budget(st, share) do
    decoding = Enum.count(st.slots, fn {_, s} -> s.state == :generating end)
    min(max(st.config.n_batch - share, decoding), st.config.n_batch)
  end
end
