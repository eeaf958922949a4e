defmodule LlamaCppEx.Server.Strategy.Batch do
  @moduledoc """
  Helpers shared by batch strategies. Entries are accumulated in reverse and returned in
  forward order by `finish/2`.
  """

  @doc """
  Adds one decode entry `{pending_token, pos, seq_id, true}` per `:generating` slot with a
  pending token, in the order of `order` (ascending seq_id by default), one budget unit each.
  """
  @spec add_decode_tokens(map(), list(), non_neg_integer(), integer(), [non_neg_integer()] | nil) ::
          {list(), non_neg_integer(), map(), integer()}
  def add_decode_tokens(slots, entries, n_entries, budget, order \\ nil)

  def add_decode_tokens(slots, entries, n_entries, budget, _order) when budget <= 0,
    do: {entries, n_entries, slots, budget}

  def add_decode_tokens(slots, entries, n_entries, budget, order) do
    order = order || slots |> Map.keys() |> Enum.sort()

    Enum.reduce(order, {entries, n_entries, slots, budget}, fn seq, {es, n, ss, b} ->
      slot = Map.fetch!(ss, seq)

      if b > 0 and slot.state == :generating and slot.pending_token != nil and
           not slot.pending_eog do
        entry = {slot.pending_token, slot.pos, seq, true}

        slot = %{
          slot
          | batch_idx: n,
            generated_token_ids: [slot.pending_token | slot.generated_token_ids],
            pending_token: nil
        }

        {[entry | es], n + 1, Map.put(ss, seq, slot), b - 1}
      else
        {es, n, ss, b}
      end
    end)
  end

  @doc """
  Adds prefill chunks for `:prefilling` slots (in `order`, ascending seq_id by default): up
  to `min(budget, chunk_size, remaining prompt)` tokens each; only the last token of the chunk
  that completes the prompt asks for logits.
  """
  @spec add_prefill_chunks(
          map(),
          list(),
          non_neg_integer(),
          integer(),
          pos_integer(),
          [non_neg_integer()] | nil
        ) ::
          {list(), non_neg_integer(), map(), integer()}
  def add_prefill_chunks(slots, entries, n_entries, budget, chunk_size, order \\ nil) do
    order = order || slots |> Map.keys() |> Enum.sort()

    Enum.reduce(order, {entries, n_entries, slots, budget}, fn seq, {es, n, ss, b} ->
      slot = Map.fetch!(ss, seq)
      remaining = slot.n_prompt_tokens - slot.prefill_pos

      if b > 0 and slot.state == :prefilling and remaining > 0 do
        len = Enum.min([b, chunk_size, remaining])
        completes = len == remaining

        {es, n} =
          Enum.reduce(0..(len - 1), {es, n}, fn i, {es, n} ->
            p = slot.prefill_pos + i
            logits = completes and i == len - 1
            {[{elem(slot.prompt_tokens_tuple, p), p, seq, logits} | es], n + 1}
          end)

        slot = %{
          slot
          | prefill_pos: slot.prefill_pos + len,
            batch_idx: if(completes, do: n - 1, else: -1)
        }

        {es, n, Map.put(ss, seq, slot), b - len}
      else
        {es, n, ss, b}
      end
    end)
  end

  @doc "Returns the entries in forward order with the slots."
  @spec finish({list(), non_neg_integer(), map(), integer()}) :: {list(), map()}
  def finish({entries, _n, slots, _budget}), do: {Enum.reverse(entries), slots}

  @doc "Seq ids of slots in `state`, sorted by `key_fun` (ascending)."
  @spec order(map(), atom(), (map() -> term())) :: [non_neg_integer()]
  def order(slots, state, key_fun) do
    slots
    |> Enum.filter(fn {_, s} -> s.state == state end)
    |> Enum.sort_by(fn {seq, s} -> {key_fun.(s), seq} end)
    |> Enum.map(&elem(&1, 0))
  end
end
