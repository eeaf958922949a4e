defmodule LlamaCppEx.Server.Strategy.Batch do
  @moduledoc """
  Helpers shared by batch strategies (see `LlamaCppEx.Server.BatchStrategy`).

  For plans (`plan/4`): a plan is built in reverse with `decode/3` and `prefill/4` (each
  returns the plan so far and the budget left) and returned in forward order by `finish/1`.

  For the contract's `build_batch/4`: `add_decode_tokens/4` and `add_prefill_chunks/5` take
  and return `{entries, n_entries, slots, budget}`, entries prepended (reverse them once at
  the end) and `n_entries` counting them, as in `llama_cpp_ex`.
  """

  alias LlamaCppEx.Server.Slot
  alias LlamaCppEx.Server.Strategy.Contract

  @doc """
  One `{pending_token, pos, seq_id, true}` per generating slot map with a pending token,
  ascending seq_id, one budget unit each; each sets its slot's `batch_idx` (the entry's
  index) and prepends the token to `generated_token_ids`. A budget of 0 or less adds nothing.
  """
  @spec add_decode_tokens(map(), list(), non_neg_integer(), integer()) ::
          {list(), non_neg_integer(), map(), integer()}
  def add_decode_tokens(slots, entries, n_entries, budget) do
    slots
    |> Enum.filter(fn {_, m} -> m.state == :generating and m.pending_token != nil end)
    |> Enum.sort_by(&elem(&1, 0))
    |> Enum.reduce({entries, n_entries, slots, budget}, fn
      _, {_, _, _, b} = acc when b <= 0 ->
        acc

      {seq, _}, {es, n, slots, b} ->
        {es, n, slots} = Contract.feed_decode(slots, seq, es, n)
        {es, n, slots, b - 1}
    end)
  end

  @doc """
  One chunk per prefilling slot map (ascending seq_id) of
  `min(budget left, chunk_size, prompt tokens left)` entries
  `{token, pos, seq_id, logits?}`, logits only on the token that completes the prompt; each
  advances `prefill_pos` and sets `batch_idx` (the last entry's index when the chunk
  completes the prompt, else -1).
  """
  @spec add_prefill_chunks(map(), list(), non_neg_integer(), integer(), pos_integer()) ::
          {list(), non_neg_integer(), map(), integer()}
  def add_prefill_chunks(slots, entries, n_entries, budget, chunk_size) do
    slots
    |> Enum.filter(fn {_, m} -> m.state == :prefilling end)
    |> Enum.sort_by(&elem(&1, 0))
    |> Enum.reduce({entries, n_entries, slots, budget}, fn
      _, {_, _, _, b} = acc when b <= 0 ->
        acc

      {seq, m}, {es, n, slots, b} ->
        case Enum.min([b, chunk_size, m.n_prompt_tokens - m.prefill_pos]) do
          k when k > 0 ->
            {es, n, slots} = Contract.feed_prefill(slots, seq, k, es, n)
            {es, n, slots, b - k}

          _ ->
            {es, n, slots, b}
        end
    end)
  end

  @type acc :: {[LlamaCppEx.Server.BatchStrategy.plan_item()], integer()}

  @doc "An empty plan with `budget` tokens."
  @spec start(integer()) :: acc()
  def start(budget), do: {[], budget}

  @doc """
  One `{:decode, seq}` per generating slot with a pending token, in `order` (ascending seq_id
  by default), one budget unit each.
  """
  @spec decode(acc(), map(), [non_neg_integer()] | nil) :: acc()
  def decode({plan, budget}, slots, order \\ nil) do
    Enum.reduce(order || Enum.sort(Map.keys(slots)), {plan, budget}, fn seq, {plan, b} ->
      case Map.fetch!(slots, seq) do
        %Slot{state: :generating, pending: p} when p != nil and b > 0 ->
          {[{:decode, seq} | plan], b - 1}

        _ ->
          {plan, b}
      end
    end)
  end

  @doc """
  One `{:prefill, seq, n}` per prefilling slot (in `order`, ascending seq_id by default), with
  `n = min(budget left, chunk_size, prompt tokens left)`.
  """
  @spec prefill(acc(), map(), pos_integer(), [non_neg_integer()] | nil) :: acc()
  def prefill({plan, budget}, slots, chunk_size, order \\ nil) do
    Enum.reduce(order || Enum.sort(Map.keys(slots)), {plan, budget}, fn seq, {plan, b} ->
      case Map.fetch!(slots, seq) do
        %Slot{state: :prefilling} = s when b > 0 and s.n_prompt > s.prefill_pos ->
          n = Enum.min([b, chunk_size, s.n_prompt - s.prefill_pos])
          {[{:prefill, seq, n} | plan], b - n}

        _ ->
          {plan, b}
      end
    end)
  end

  @doc "The plan in forward order."
  @spec finish(acc()) :: [LlamaCppEx.Server.BatchStrategy.plan_item()]
  def finish({plan, _budget}), do: Enum.reverse(plan)

  @doc "Seq ids of slots in `state`, sorted by `key_fun` (ascending), then seq_id."
  @spec order(map(), Slot.state(), (Slot.t() -> term())) :: [non_neg_integer()]
  def order(slots, state, key_fun) do
    slots
    |> Enum.filter(fn {_, s} -> s.state == state end)
    |> Enum.sort_by(fn {seq, s} -> {key_fun.(s), seq} end)
    |> Enum.map(&elem(&1, 0))
  end
end
