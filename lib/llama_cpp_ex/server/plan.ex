defmodule LlamaCppEx.Server.Plan do
  @moduledoc false
  # A strategy's plan checked, then turned into the step the engine runs: batch entries
  # `{token, pos, seq, logits?}`, the samplers of the rows that have logits, the speculating
  # decodes, and the slots as they will be once the step ran.

  alias LlamaCppEx.Engine.{Spec, Step}
  alias LlamaCppEx.Server.Slot
  alias LlamaCppEx.Server.Strategy.Contract

  @doc """
  The plan of `strategy` for `slots` this tick (its `plan/4`, or its contract-shaped
  `build_batch/4` through `LlamaCppEx.Server.Strategy.Contract`), checked: an
  `ArgumentError` names the strategy and what it returned.
  """
  @spec of(module(), map(), pos_integer(), pos_integer(), keyword(), reference()) :: list()
  def of(strategy, slots, budget, chunk_size, opts, model_ref) do
    if function_exported?(strategy, :plan, 4) do
      strategy.plan(slots, budget, chunk_size, opts)
      |> validate!(slots, budget, chunk_size, "#{inspect(strategy)}.plan/4")
    else
      Contract.plan(strategy, slots, budget, chunk_size, opts, model_ref)
      |> validate!(slots, budget, chunk_size, "#{inspect(strategy)}.build_batch/4")
    end
  end

  @doc "The plan, or an `ArgumentError` naming `callback` (the strategy's) and the plan."
  @spec validate!(term(), map(), pos_integer(), pos_integer(), String.t()) :: list()
  def validate!(plan, slots, budget, chunk_size, callback) do
    fail = fn why ->
      raise ArgumentError,
            "#{callback} returned an invalid plan (#{why}): #{inspect(plan, limit: 20)}"
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
  The step of a checked plan (`entries`, `samplers`, `specs`: its speculating decodes), the
  slots as they will be once it ran (prompt positions advanced, pending tokens fed), and
  `%{decode: rows, prefill: tokens}`.
  """
  @spec to_step(list(), map()) ::
          {Step.t(), map(), %{decode: non_neg_integer(), prefill: non_neg_integer()}}
  def to_step(plan, slots) do
    {entries, slots, samplers, specs, counts} =
      Enum.reduce(plan, {[], slots, [], [], %{decode: 0, prefill: 0}}, fn
        {:decode, seq}, {es, ss, samplers, specs, c} ->
          s = Map.fetch!(ss, seq)
          entry = {s.pending, s.pos, seq, true}
          s = %{s | fed: [s.pending | s.fed], pending: nil}
          {s, specs} = speculate(s, specs)
          samplers = [{seq, s.request.sampler.ref} | samplers]
          {[entry | es], Map.put(ss, seq, s), samplers, specs, %{c | decode: c.decode + 1}}

        {:prefill, seq, n}, {es, ss, samplers, specs, c} ->
          s = Map.fetch!(ss, seq)
          completes = s.prefill_pos + n == s.n_prompt

          es =
            Enum.reduce(0..(n - 1), es, fn i, es ->
              p = s.prefill_pos + i
              [{elem(s.prompt, p), p, seq, completes and i == n - 1} | es]
            end)

          samplers = if completes, do: [{seq, s.request.sampler.ref} | samplers], else: samplers
          s = %{s | prefill_pos: s.prefill_pos + n}
          {es, Map.put(ss, seq, s), samplers, specs, %{c | prefill: c.prefill + n}}
      end)

    step = %Step{
      entries: Enum.reverse(entries),
      samplers: Enum.reverse(samplers),
      specs: Enum.reverse(specs)
    }

    {step, slots, counts}
  end

  # A speculating request's decode sends the engine what its sequence took since its last
  # speculating step (the engine drafts from its own copy of the sequence's tokens): the
  # whole sequence the first time, then the generated tokens fed since, the one decoded now
  # last. `s.pos` is that token's position, so the sequence then holds `s.pos + 1` tokens.
  defp speculate(%Slot{request: %{n_draft: nil}} = s, specs), do: {s, specs}

  defp speculate(%Slot{request: r} = s, specs) do
    held = s.pos + 1

    tokens =
      if r.spec_sent == 0,
        do: Slot.fed_tokens(s),
        else: s.fed |> Enum.take(held - r.spec_sent) |> Enum.reverse()

    spec = %Spec{
      seq: s.seq,
      tokens: tokens,
      reset: r.spec_sent == 0,
      n_draft: r.n_draft,
      draft_model: r.draft_model?
    }

    {%{s | request: %{r | spec_sent: held}}, [spec | specs]}
  end
end
