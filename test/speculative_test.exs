defmodule LlamaCppEx.SpeculativeTest do
  @moduledoc """
  Prompt-lookup speculative decoding on the model route (SmolLM2): the same text as without
  it, greedy and seeded, on generate and stream; bad options raise. (The engine's
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

  test "invalid speculation options raise", %{model: model} do
    assert_raise ArgumentError, ~r/:draft/, fn ->
      LlamaCppEx.generate(model, "hi", max_tokens: 2, speculative: [mode: :draft])
    end

    assert_raise ArgumentError, ~r/n_draft/, fn ->
      LlamaCppEx.generate(model, "hi", max_tokens: 2, speculative: [n_draft: 0])
    end
  end
end
