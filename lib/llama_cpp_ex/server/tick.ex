defmodule LlamaCppEx.Server.Tick do
  @moduledoc false
  # The server's cycle. A tick (after the pause level is asked) places queued requests into
  # idle slots, asks the strategy for a plan, adds waiting embedding texts, and submits ONE
  # step (the KV operations decided since the last one, then one forward pass) to the engine
  # thread; the GenServer keeps serving messages while it runs. Its outcome is applied by
  # `LlamaCppEx.Server.Outcome`, and the next tick follows while there is work. At most one
  # step is in flight.

  alias LlamaCppEx.Engine
  alias LlamaCppEx.Engine.Step
  alias LlamaCppEx.Server.{Embeds, Lifecycle, Outcome, Pause, Placement, Plan, PromptCache}
  alias LlamaCppEx.Server.{Slot, State}
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

  @doc "Applies the outcome of the step in flight, then ticks again while there is work."
  @spec apply_outcome(State.t(), Engine.Outcome.t()) :: State.t()
  def apply_outcome(st, outcome), do: st |> Outcome.apply(outcome) |> continue()

  @doc "Fails what the step in flight carried, then ticks again while there is work."
  @spec apply_error(State.t(), term()) :: State.t()
  def apply_error(st, reason), do: st |> Outcome.apply_error(reason) |> continue()

  @doc "Cancels the request or embedding call `ref`."
  @spec cancel(State.t(), reference()) :: State.t()
  def cancel(st, ref), do: st |> Lifecycle.cancel(ref) |> schedule()

  @doc "The consumer behind monitor `mref` died."
  @spec consumer_down(State.t(), reference()) :: State.t()
  def consumer_down(st, mref), do: st |> Lifecycle.consumer_down(mref) |> schedule()

  defp continue(st), do: if(has_work?(st), do: schedule(st), else: st)

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
      purgeable =
        slots
        |> Enum.filter(fn {_, s} -> s.state == :idle and s.cached != [] end)
        |> Enum.sort_by(fn {seq, s} -> {s.t_last_used, seq} end)
        |> Enum.map(&elem(&1, 0))

      step = %Step{
        step
        | ops: st.pending_ops,
          entries: step.entries ++ embed_entries,
          purgeable: purgeable,
          save_purged_max_bytes: PromptCache.purge_save_bytes(st.prompt_cache),
          embeds: embeds
      }

      ref = make_ref()
      :ok = Engine.submit(st.engine, ref, step)

      flight = %{
        ref: ref,
        decode: counts.decode,
        prefill: counts.prefill,
        save_tags: for({:save, _, _, _, tag} <- st.pending_ops, do: tag),
        embed: length(embed_entries),
        embeds: placed
      }

      %{st | slots: slots, pending_ops: [], tick: st.tick + 1, in_flight: flight}
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
