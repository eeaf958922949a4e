defmodule LlamaCppEx.Server.Strategy.Batch do
  @moduledoc """
  Helpers shared by batch strategies. A plan is built in reverse with `decode/4` and
  `prefill/5` (each returns the plan so far and the budget left) and returned in forward order
  by `finish/1`.
  """

  alias LlamaCppEx.Server.Slot

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
