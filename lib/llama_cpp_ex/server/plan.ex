defmodule LlamaCppEx.Server.Plan do
  @moduledoc false
  # A strategy's plan checked, then turned into the step the engine runs: batch entries
  # `{token, pos, seq, logits?}`, the samplers of the rows that have logits, and the slots
  # as they will be once the step ran (prompt positions advanced, pending tokens fed).

  alias LlamaCppEx.Server.Slot

  @doc "The plan, or an `ArgumentError` naming `strategy` and what it returned."
  @spec validate!(term(), map(), pos_integer(), pos_integer(), module()) :: list()
  def validate!(plan, slots, budget, chunk_size, strategy) do
    fail = fn why ->
      raise ArgumentError,
            "#{inspect(strategy)}.build_batch/4 returned an invalid plan (#{why}): #{inspect(plan, limit: 20)}"
    end

    unless is_list(plan), do: fail.("not a list")

    {tokens, _seen} =
      Enum.reduce(plan, {0, MapSet.new()}, fn item, {n, seen} ->
        seq =
          case item do
            {:decode, seq} -> seq
            {:prefill, seq, _} -> seq
            _ -> fail.("unknown item #{inspect(item)}")
          end

        if MapSet.member?(seen, seq), do: fail.("seq #{inspect(seq)} appears twice")

        case {item, Map.get(slots, seq)} do
          {_, nil} ->
            fail.("no slot #{inspect(seq)}")

          {{:decode, _}, %Slot{state: :generating, pending: p}} when p != nil ->
            {n + 1, MapSet.put(seen, seq)}

          {{:decode, _}, _} ->
            fail.("slot #{seq} has no token to decode")

          {{:prefill, _, k}, %Slot{state: :prefilling} = s}
          when is_integer(k) and k > 0 and k <= chunk_size and k <= s.n_prompt - s.prefill_pos ->
            {n + k, MapSet.put(seen, seq)}

          {{:prefill, _, k}, _} ->
            fail.("prefill of #{inspect(k)} tokens does not fit slot #{seq}")
        end
      end)

    if tokens > budget, do: fail.("#{tokens} tokens exceed the budget of #{budget}")
    plan
  end

  @doc """
  `{entries, slots, samplers, counts}` for a checked plan; `counts` is
  `%{decode: n, prefill: m, specs: [{seq, history, n_draft, draft_model?}]}` (the
  speculating decodes).
  """
  @spec to_step(list(), map()) :: {list(), map(), list(), map()}
  def to_step(plan, slots) do
    {entries, slots, samplers, counts} =
      Enum.reduce(plan, {[], slots, [], %{decode: 0, prefill: 0, specs: []}}, fn
        {:decode, seq}, {es, ss, samplers, c} ->
          s = Map.fetch!(ss, seq)
          entry = {s.pending, s.pos, seq, true}
          s = %{s | fed: [s.pending | s.fed], pending: nil}
          c = %{c | decode: c.decode + 1}

          # the engine drafts (by lookup or with the draft model) from the sequence's tokens,
          # the one to decode last
          r = s.request

          c =
            if r.n_draft,
              do: %{c | specs: [{seq, Slot.fed_tokens(s), r.n_draft, r.draft_model?} | c.specs]},
              else: c

          {[entry | es], Map.put(ss, seq, s), [{seq, s.request.sampler.ref} | samplers], c}

        {:prefill, seq, n}, {es, ss, samplers, c} ->
          s = Map.fetch!(ss, seq)
          completes = s.prefill_pos + n == s.n_prompt

          es =
            Enum.reduce(0..(n - 1), es, fn i, es ->
              p = s.prefill_pos + i
              [{elem(s.prompt, p), p, seq, completes and i == n - 1} | es]
            end)

          samplers = if completes, do: [{seq, s.request.sampler.ref} | samplers], else: samplers
          s = %{s | prefill_pos: s.prefill_pos + n}
          {es, Map.put(ss, seq, s), samplers, %{c | prefill: c.prefill + n}}
      end)

    {Enum.reverse(entries), slots, Enum.reverse(samplers), counts}
  end
end
