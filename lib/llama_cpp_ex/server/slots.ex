defmodule LlamaCppEx.Server.Slots do
  @moduledoc false
  # Pure slot-selection helpers: prefix matching, affinity and LRU choice.

  alias LlamaCppEx.NIF
  alias LlamaCppEx.Server.Slot

  @doc "Length of the common prefix of two token lists."
  @spec common_prefix_length([integer()], [integer()]) :: non_neg_integer()
  def common_prefix_length(a, b), do: lcp(a, b, 0)

  defp lcp([x | a], [x | b], n), do: lcp(a, b, n + 1)
  defp lcp(_, _, n), do: n

  @doc "The seq_id last used with `key` if that slot is idle."
  @spec session_slot_if_idle(map(), term(), [{non_neg_integer(), Slot.t()}]) ::
          non_neg_integer() | nil
  def session_slot_if_idle(_sessions, nil, _idle), do: nil

  def session_slot_if_idle(sessions, key, idle_slots) do
    with seq when is_integer(seq) <- Map.get(sessions, key),
         true <- Enum.any?(idle_slots, fn {s, _} -> s == seq end) do
      seq
    else
      _ -> nil
    end
  end

  @doc """
  The idle slot whose cached tokens share the longest prefix with `tokens`, as `{seq_id, lcp}`,
  when that prefix is more than 10% of the prompt; otherwise `{lru_seq_id, 0}`. `nil` when
  there are no idle slots.
  """
  @spec pick_cached_slot([{non_neg_integer(), Slot.t()}], [integer()]) ::
          {non_neg_integer(), non_neg_integer()} | nil
  def pick_cached_slot([], _tokens), do: nil

  def pick_cached_slot(idle_slots, []), do: {pick_lru_slot(idle_slots), 0}

  def pick_cached_slot(idle_slots, tokens) do
    n = length(tokens)

    {seq, best} =
      idle_slots
      |> Enum.map(fn {seq, slot} -> {seq, common_prefix_length(slot.cached, tokens)} end)
      |> Enum.max_by(fn {seq, l} -> {l, -seq} end)

    if best * 10 > n, do: {seq, best}, else: {pick_lru_slot(idle_slots), 0}
  end

  @doc "The idle slot used least recently."
  @spec pick_lru_slot([{non_neg_integer(), Slot.t()}]) :: non_neg_integer() | nil
  def pick_lru_slot([]), do: nil

  def pick_lru_slot(idle_slots) do
    {seq, _} = Enum.min_by(idle_slots, fn {seq, slot} -> {slot.t_last_used, seq} end)
    seq
  end

  @doc """
  How many leading tokens of `tokens` a slot's KV cache already holds: idle slots their
  cached tokens, prefilling slots the prompt tokens fed so far, generating slots the prompt
  plus the generated tokens fed so far.
  """
  @spec donor_prefix_match(Slot.t(), [integer()]) :: non_neg_integer()
  def donor_prefix_match(%Slot{state: :idle, cached: cached}, tokens),
    do: common_prefix_length(cached, tokens)

  def donor_prefix_match(%Slot{state: :prefilling} = slot, tokens),
    do: min(common_prefix_length(Tuple.to_list(slot.prompt), tokens), slot.prefill_pos)

  def donor_prefix_match(%Slot{state: :generating} = slot, tokens) do
    n_prompt = slot.n_prompt
    lcp = common_prefix_length(Tuple.to_list(slot.prompt), tokens)

    if lcp < n_prompt do
      lcp
    else
      rest = Enum.drop(tokens, n_prompt)
      min(n_prompt + common_prefix_length(Enum.reverse(slot.fed), rest), Slot.fed_length(slot))
    end
  end

  @doc """
  Whether the first `n` tokens of a sequence holding `len` tokens can be continued on a model
  whose sliding-window layers (window `window`, 0 = none) dropped old blocks: the engine's
  rule (`llama_cpp_ex_engine::kv::window_keeps_prefix`).
  """
  @spec prefix_usable?(non_neg_integer(), non_neg_integer(), non_neg_integer()) :: boolean()
  def prefix_usable?(_len, _n, 0), do: true
  def prefix_usable?(len, n, window), do: NIF.kv_prefix_usable(len, n, window)
end
