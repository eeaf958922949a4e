defmodule LlamaCppEx.Server.Tick do
  @moduledoc false
  # The server's cycle. A tick places queued requests into idle slots, asks the strategy for
  # a plan, and submits ONE step (the KV operations decided since the last one, then one
  # forward pass) to the engine thread; the GenServer keeps serving messages while it runs.
  # When the outcome arrives, each sampled token goes through its request's pipeline, the
  # events go to the request's consumer, and requests that ended free their slots. At most
  # one step is in flight.

  alias LlamaCppEx.{NIF, Pipeline, Telemetry}
  alias LlamaCppEx.Server.{Placement, Plan, Request, Slot, Stats}

  @doc "Sends `:tick` unless one is pending or a step is in flight."
  def schedule(%{tick_scheduled: true} = st), do: st
  def schedule(%{in_flight: f} = st) when f != nil, do: st

  def schedule(st) do
    send(self(), :tick)
    %{st | tick_scheduled: true}
  end

  def has_work?(st) do
    Enum.any?(st.slots, fn {_, s} -> Slot.active?(s) end) or
      not :queue.is_empty(st.queue) or st.pending_ops != []
  end

  @doc "One tick: place, plan, submit."
  def run(st) do
    st = %{st | tick_scheduled: false}

    if st.in_flight != nil or st.model == nil,
      do: st,
      else: st |> Placement.dequeue() |> submit()
  end

  defp submit(st) do
    cfg = st.config
    opts = [queue_depth: :queue.len(st.queue), tick: st.tick]
    plan = cfg.batch_strategy.build_batch(st.slots, cfg.n_batch, cfg.chunk_size, opts)
    plan = Plan.validate!(plan, st.slots, cfg.n_batch, cfg.chunk_size, cfg.batch_strategy)
    {entries, slots, samplers, counts} = Plan.to_step(plan, st.slots)

    if entries == [] and st.pending_ops == [] do
      st
    else
      purgeable =
        slots
        |> Enum.filter(fn {_, s} -> s.state == :idle and s.cached != [] end)
        |> Enum.sort_by(fn {seq, s} -> {s.t_last_used, seq} end)
        |> Enum.map(&elem(&1, 0))

      ref = make_ref()

      :ok =
        NIF.engine_submit(st.engine, self(), ref, {st.pending_ops, entries, samplers, purgeable})

      %{
        st
        | slots: slots,
          pending_ops: [],
          tick: st.tick + 1,
          in_flight: Map.put(counts, :ref, ref)
      }
    end
  end

  @doc "Applies a step's outcome."
  def apply_outcome(st, {sampled, purged, n_splits, failed, eval_us}) do
    flight = st.in_flight
    st = %{st | in_flight: nil}

    st = %{
      st
      | slots:
          Enum.reduce(purged, st.slots, fn seq, slots ->
            Map.update!(slots, seq, &%{&1 | cached: []})
          end)
    }

    st = Enum.reduce(failed, st, &fail(&2, &1, :context_full))
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
        batch_size: flight.decode + flight.prefill,
        decode_tokens: flight.decode,
        prefill_tokens: flight.prefill,
        active_slots: Enum.count(st.slots, fn {_, s} -> Slot.active?(s) end),
        queue_depth: :queue.len(st.queue),
        eval_ms: eval_us / 1000
      },
      %{server: self()}
    )

    if has_work?(st), do: schedule(st), else: st
  end

  @doc "A failed step fails every active request."
  def apply_error(st, reason) do
    st = %{st | in_flight: nil}

    st =
      st.slots
      |> Enum.filter(fn {_, s} -> Slot.active?(s) end)
      |> Enum.reduce(st, fn {seq, _}, st -> fail(st, seq, {:inference_failed, reason}) end)

    if has_work?(st), do: schedule(st), else: st
  end

  defp apply_sample({seq, token, piece, eog, logprobs}, st) do
    case Map.fetch!(st.slots, seq) do
      # the request ended while this step ran (cancelled)
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
    ops = if r.cache_prompt, do: st.pending_ops, else: st.pending_ops ++ [{:clear, seq}]
    %{st | slots: Map.put(st.slots, seq, Slot.release(slot, Stats.now_ms())), pending_ops: ops}
  end

  defp clear_cache(st, seq) do
    slots = Map.update!(st.slots, seq, &%{&1 | cached: []})
    %{st | slots: slots, pending_ops: st.pending_ops ++ [{:clear, seq}]}
  end

  @doc "Cancels the request streaming to `ref`, active or queued."
  def cancel(st, ref) do
    case Enum.find(st.slots, fn {_, s} -> s.request && s.request.stream_ref == ref end) do
      {seq, _} ->
        st |> finish(seq, :cancelled) |> schedule()

      nil ->
        drop_queued(st, &(&1.stream_ref == ref))
    end
  end

  @doc "The consumer behind monitor `mref` died: its requests go."
  def consumer_down(st, mref) do
    st =
      st.slots
      |> Enum.filter(fn {_, s} -> s.request && s.request.monitor_ref == mref end)
      |> Enum.reduce(st, fn {seq, _}, st -> finish(st, seq, :cancelled) end)

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
