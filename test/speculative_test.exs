defmodule LlamaCppEx.SpeculativeTest do
  @moduledoc """
  Speculative decoding on the model route (SmolLM2), from prompt lookup and from a draft
  model: the same text as without it, greedy and seeded, on generate and stream; bad options
  raise. (The engine's
  `tests/speculative.rs` checks the tokens, the KV rollback and the acceptance.)
  """
  use ExUnit.Case, async: true

  alias LlamaCppEx.TestModels

  @paragraph "The committee met on Tuesday to review the budget for the new library. After a " <>
               "long discussion, the members agreed to fund the children's reading room and to " <>
               "extend the opening hours on weekends."

  setup_all do
    %{model: TestModels.smollm2()}
  end

  test "the same text with and without speculation", %{model: model} do
    messages = [%{role: "user", content: "Repeat this text exactly:\n" <> @paragraph}]

    for opts <- [[temp: 0.0], [temp: 0.8, seed: 11, penalty_repeat: 1.1]] do
      opts = [max_tokens: 60] ++ opts
      {:ok, plain} = LlamaCppEx.chat(model, messages, opts)

      {:ok, fast} =
        LlamaCppEx.chat(
          model,
          messages,
          [speculative: [mode: :prompt_lookup, n_draft: 6]] ++ opts
        )

      assert fast == plain

      streamed =
        model
        |> LlamaCppEx.stream_chat(messages, [speculative: []] ++ opts)
        |> Enum.join()

      assert streamed == plain
    end
  end

  test "a draft model: the same text, drafts accepted and rejected", %{model: draft} do
    # the target is SmolLM2 re-quantized to Q8_0, the draft its Q4_1 file: they disagree now
    # and then
    {:ok, target} = LlamaCppEx.load_model(TestModels.smollm2_path(), requantize: :all)
    messages = [%{role: "user", content: "Write a short poem about the sea."}]

    for opts <- [[temp: 0.0], [temp: 0.8, seed: 11, penalty_repeat: 1.1]] do
      opts = [max_tokens: 48] ++ opts
      {:ok, plain} = LlamaCppEx.chat(target, messages, opts)

      {:ok, fast} =
        LlamaCppEx.chat(
          target,
          messages,
          [speculative: [mode: :draft, draft_model: draft]] ++ opts
        )

      assert fast == plain

      streamed =
        target
        |> LlamaCppEx.stream_chat(
          messages,
          [speculative: [mode: :draft, draft_model: TestModels.smollm2_path(), n_draft: 6]] ++
            opts
        )
        |> Enum.join()

      assert streamed == plain
    end

    {:ok, tokens} = LlamaCppEx.Tokenizer.encode(target, "The capital of France is")

    opts =
      LlamaCppEx.Generation.options!(
        [max_tokens: 32, temp: 0.0, speculative: [mode: :draft, draft_model: draft]],
        :model
      )

    {:ok, gen} = LlamaCppEx.Generation.prepare(target, tokens, opts, :model)
    {:ok, s} = LlamaCppEx.Stepper.start(gen, [])
    s = run_local(s)
    {drafted, accepted} = LlamaCppEx.Stepper.speculation(s)
    assert drafted > 0 and accepted > 0 and accepted <= drafted
  end

  test "a draft model with another vocabulary is an error", %{model: model} do
    {:ok, gemma} = LlamaCppEx.load_model(TestModels.gemma3_path())

    assert {:error, msg} =
             LlamaCppEx.generate(model, "hi",
               max_tokens: 2,
               speculative: [mode: :draft, draft_model: gemma]
             )

    assert msg =~ "vocabulary"
  end

  defp run_local(s) do
    case LlamaCppEx.Stepper.step(s) do
      {:cont, _, s} -> run_local(s)
      {:done, _, s} -> s
    end
  end

  test "invalid speculation options raise", %{model: model} do
    assert_raise ArgumentError, ~r/draft_model/, fn ->
      LlamaCppEx.generate(model, "hi", max_tokens: 2, speculative: [mode: :draft])
    end

    assert_raise ArgumentError, ~r/draft_model/, fn ->
      LlamaCppEx.generate(model, "hi", max_tokens: 2, speculative: [draft_model: model])
    end

    assert_raise ArgumentError, ~r/n_draft/, fn ->
      LlamaCppEx.generate(model, "hi", max_tokens: 2, speculative: [n_draft: 0])
    end
  end
end
