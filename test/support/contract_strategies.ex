defmodule LlamaCppEx.Test.ContractStrategies do
  @moduledoc false
  # Batch strategies as a `llama_cpp_ex` user writes them (the contract's `build_batch/4`:
  # slot maps in, `{entries, slots}` out), and slot maps as the contract's test_slots builds
  # them, for the tests that run such strategies here.

  @doc "A contract slot map: the 29 fields, idle, with `overrides`."
  def slot(overrides \\ []) do
    base = %{
      state: :idle,
      from: nil,
      stream_pid: nil,
      stream_ref: nil,
      monitor_ref: nil,
      reply_mode: nil,
      cache_prompt: true,
      prompt_tokens: [],
      prompt_tokens_tuple: {},
      prefill_pos: 0,
      pos: 0,
      pending_token: nil,
      pending_eog: false,
      batch_idx: -1,
      tokens_generated: 0,
      max_tokens: 16,
      accumulated_pieces: [],
      utf8_pending: "",
      t_start: nil,
      t_first_token: nil,
      n_prompt_tokens: 0,
      cached_tokens: [],
      cached_pos: 0,
      cache_scope: nil,
      generated_token_ids: [],
      n_prefix_cache_tokens: 0,
      sampler: nil,
      t_last_used: 0,
      session: nil
    }

    Map.merge(base, Map.new(overrides))
  end

  def prefilling(tokens),
    do:
      slot(
        state: :prefilling,
        prompt_tokens: tokens,
        prompt_tokens_tuple: List.to_tuple(tokens),
        n_prompt_tokens: length(tokens)
      )

  def generating(token, pos), do: slot(state: :generating, pending_token: token, pos: pos)

  defmodule GreedyDecodeFirst do
    @moduledoc false
    @behaviour LlamaCppEx.Server.BatchStrategy
    alias LlamaCppEx.Server.Strategy.Batch

    @impl true
    def build_batch(slots, budget, chunk_size, _opts) do
      {entries, n, slots, budget} = Batch.add_decode_tokens(slots, [], 0, budget)
      {entries, _, slots, _} = Batch.add_prefill_chunks(slots, entries, n, budget, chunk_size)
      {Enum.reverse(entries), slots}
    end
  end

  defmodule PrefillFirst do
    @moduledoc false
    @behaviour LlamaCppEx.Server.BatchStrategy
    alias LlamaCppEx.Server.Strategy.Batch

    @impl true
    def build_batch(slots, budget, chunk_size, _opts) do
      {entries, n, slots, budget} = Batch.add_prefill_chunks(slots, [], 0, budget, chunk_size)
      {entries, _, slots, _} = Batch.add_decode_tokens(slots, entries, n, budget)
      {Enum.reverse(entries), slots}
    end
  end

  defmodule RoundRobin do
    @moduledoc false
    # One token per slot per round (a decode, or the next prompt token), rounds repeated
    # until the budget is spent; written by hand against the slot fields.
    @behaviour LlamaCppEx.Server.BatchStrategy

    @impl true
    def build_batch(slots, budget, chunk_size, _opts) do
      ids = slots |> Map.keys() |> Enum.sort()
      rounds(slots, ids, budget, chunk_size, %{}, [])
    end

    defp rounds(slots, ids, budget, chunk_size, taken, entries) do
      {entries, taken, left} =
        Enum.reduce(ids, {entries, taken, budget}, fn seq, {es, tk, b} ->
          slot = slots[seq]
          k = Map.get(tk, seq, 0)

          cond do
            b <= 0 ->
              {es, tk, b}

            slot.state == :generating and slot.pending_token != nil and k == 0 ->
              {[{slot.pending_token, slot.pos, seq, true} | es], Map.put(tk, seq, 1), b - 1}

            slot.state == :prefilling and k < chunk_size and
                slot.prefill_pos + k < slot.n_prompt_tokens ->
              p = slot.prefill_pos + k
              entry = {elem(slot.prompt_tokens_tuple, p), p, seq, p == slot.n_prompt_tokens - 1}
              {[entry | es], Map.put(tk, seq, k + 1), b - 1}

            true ->
              {es, tk, b}
          end
        end)

      if left < budget and left > 0,
        do: rounds(slots, ids, left, chunk_size, taken, entries),
        else: {Enum.reverse(entries), advance(slots, taken)}
    end

    defp advance(slots, taken) do
      Enum.reduce(taken, slots, fn {seq, k}, acc ->
        Map.update!(acc, seq, fn
          %{state: :prefilling} = s -> %{s | prefill_pos: s.prefill_pos + k}
          s -> s
        end)
      end)
    end
  end

  defmodule Raising do
    @moduledoc false
    # reads a field no slot has: raises inside the tick
    @behaviour LlamaCppEx.Server.BatchStrategy

    @impl true
    def build_batch(slots, _budget, _chunk_size, _opts) do
      Enum.each(slots, fn {_, s} -> Map.fetch!(s, :no_such_field) end)
      {[], slots}
    end
  end
end
