defmodule LlamaCppEx.Server.Lifecycle do
  @moduledoc false
  # How a request ends: normally (`:eog`, `:max_tokens`, `:stop`), cancelled (its consumer
  # halted, timed out or died) or failed; its slot goes idle, keeping what it fed as cache
  # unless the cache is no longer reliable, and the KV operations that make the cache what the
  # slot says it holds go with the next step.

  alias LlamaCppEx.{Pipeline, Telemetry}
  alias LlamaCppEx.Server.{Embeds, Request, Slot, State, Stats}

  @doc """
  Ends the request of slot `seq` normally or on `:cancelled` (nothing more is sent to its
  consumer).
  """
  @spec finish(State.t(), non_neg_integer(), :eog | :max_tokens | :stop | :cancelled) ::
          State.t()
  def finish(st, seq, reason) do
    slot = Map.fetch!(st.slots, seq)
    r = slot.request

    if reason != :cancelled do
      Request.deliver(r, [{:usage, usage(slot)}, {:done, reason}])
    end

    Telemetry.execute(
      [:llama_cpp_ex, :server, :request, :done],
      Stats.done_measurements(slot, Stats.now_ms()),
      %{server: self(), seq_id: seq, mode: r.mode, stop_reason: reason}
    )

    release(%{st | stats: Stats.request_done(st.stats, r)}, slot)
  end

  defp usage(slot),
    do: %{prompt_tokens: slot.n_prompt, completion_tokens: slot.request.pipeline.generated}

  @doc "Ends the request of slot `seq` with an error; its cache is dropped."
  @spec fail(State.t(), non_neg_integer(), term()) :: State.t()
  def fail(st, seq, reason) do
    case Map.fetch!(st.slots, seq) do
      # a request cancelled while its tokens were in flight: the cache is no longer reliable
      %Slot{request: nil} ->
        clear_cache(st, seq)

      slot ->
        r = slot.request
        Request.deliver(r, Pipeline.fail(r.pipeline, reason))

        Telemetry.execute(
          [:llama_cpp_ex, :server, :request, :exception],
          Stats.done_measurements(slot, Stats.now_ms()),
          %{server: self(), seq_id: seq, mode: r.mode, stop_reason: :error, reason: reason}
        )

        st |> release(slot) |> clear_cache(seq)
    end
  end

  defp release(st, %Slot{seq: seq, request: r} = slot) do
    if r.monitor_ref, do: Process.demonitor(r.monitor_ref, [:flush])

    # a speculating request that ended inside a verified draft leaves accepted draft tokens
    # past what it fed in the cache, and a chained one the token its queued step feeds: cut
    # them, so the cache is what the slot says it holds
    ops =
      cond do
        not r.cache_prompt ->
          st.pending_ops ++ [{:clear, seq}]

        r.n_draft != nil or slot.chained ->
          st.pending_ops ++ [{:trim, seq, Slot.fed_length(slot)}]

        true ->
          st.pending_ops
      end

    %{st | slots: Map.put(st.slots, seq, Slot.release(slot, Stats.now_ms())), pending_ops: ops}
  end

  @doc "Forgets what slot `seq` caches, in the server's books and the engine's."
  @spec clear_cache(State.t(), non_neg_integer()) :: State.t()
  def clear_cache(st, seq) do
    slots = Map.update!(st.slots, seq, &%{&1 | cached: []})
    %{st | slots: slots, pending_ops: st.pending_ops ++ [{:clear, seq}]}
  end

  @doc """
  Cancels the request streaming to `ref` (active or queued) or the embedding call `ref`; the
  caller schedules the next tick.
  """
  @spec cancel(State.t(), reference()) :: State.t()
  def cancel(st, ref) do
    case Enum.find(st.slots, fn {_, s} -> s.request && s.request.stream_ref == ref end) do
      {seq, _} -> finish(st, seq, :cancelled)
      nil -> st |> drop_queued(&(&1.stream_ref == ref)) |> Embeds.drop(ref)
    end
  end

  @doc "The consumer behind monitor `mref` died: its requests and embedding calls go."
  @spec consumer_down(State.t(), reference()) :: State.t()
  def consumer_down(st, mref) do
    st =
      st.slots
      |> Enum.filter(fn {_, s} -> s.request && s.request.monitor_ref == mref end)
      |> Enum.reduce(st, fn {seq, _}, st -> finish(st, seq, :cancelled) end)

    embeds = for {ref, j} <- st.embed_jobs, j.monitor_ref == mref, do: ref
    st = Enum.reduce(embeds, st, &Embeds.drop(&2, &1))
    drop_queued(st, &(&1.monitor_ref == mref))
  end

  defp drop_queued(st, pred) do
    {dropped, kept} = st.queue |> :queue.to_list() |> Enum.split_with(pred)

    Enum.each(dropped, fn r ->
      if r.monitor_ref, do: Process.demonitor(r.monitor_ref, [:flush])
    end)

    %{st | queue: :queue.from_list(kept)}
  end
end
