defmodule LlamaCppEx.StopTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Server, StopMatcher, TestModels}

  setup_all do
    %{model: TestModels.smollm2()}
  end

  test "the matcher holds back partial matches across chunks" do
    m = StopMatcher.new(["STOP", "\n\n"])
    {:cont, "abc", m} = StopMatcher.push(m, "abcST")
    {:cont, "STx", m} = StopMatcher.push(m, "x")
    {:cont, "", m} = StopMatcher.push(m, "S")
    {:cont, "", m} = StopMatcher.push(m, "TO")
    assert {:stop, "hello "} = StopMatcher.push(%{m | held: ""}, "hello STOP and more")
    assert {:stop, "line"} = StopMatcher.push(StopMatcher.new("\n\n"), "line\n\nnext")
    assert StopMatcher.flush(elem(StopMatcher.push(StopMatcher.new("xyz"), "abx"), 2)) == "x"
    assert StopMatcher.new([]) == nil
  end

  test "generate and stream stop before the stop string", %{model: model} do
    {:ok, full} =
      LlamaCppEx.generate(model, "The capital of France is", max_tokens: 20, temp: 0.0)

    # full is " Paris.\n\nThe answer is: ..." with re-quantized weights
    [before | _] = String.split(full, "\n\n")

    assert {:ok, ^before} =
             LlamaCppEx.generate(model, "The capital of France is",
               max_tokens: 20,
               temp: 0.0,
               stop: ["\n\n"]
             )

    assert Enum.join(
             LlamaCppEx.stream(model, "The capital of France is",
               max_tokens: 20,
               temp: 0.0,
               stop: "\n\n"
             )
           ) ==
             before

    # several stop strings, the earliest match wins, matched across token boundaries
    assert {:ok, " Par"} =
             LlamaCppEx.generate(model, "The capital of France is",
               max_tokens: 20,
               temp: 0.0,
               stop: ["is.", "is", "\n"]
             )
  end

  test "chat completions report finish_reason stop", %{model: model} do
    msgs = [%{role: "user", content: "Name the capital of France."}]
    {:ok, c} = LlamaCppEx.chat_completion(model, msgs, max_tokens: 30, temp: 0.0, stop: ["Paris"])
    assert [%{finish_reason: "stop", message: %{content: content}}] = c.choices
    refute content =~ "Paris"

    chunks =
      model
      |> LlamaCppEx.stream_chat_completion(msgs, max_tokens: 30, temp: 0.0, stop: ["Paris"])
      |> Enum.to_list()

    assert %{choices: [%{finish_reason: "stop"}]} = List.last(chunks)

    text =
      chunks |> Enum.flat_map(& &1.choices) |> Enum.map_join(&Map.get(&1.delta, :content, ""))

    assert text == content
  end

  test "stop strings through the server", %{model: model} do
    {:ok, s} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 2,
        n_ctx: 2048,
        temp: 0.0
      )

    {:ok, full} =
      LlamaCppEx.generate(model, "The capital of France is", max_tokens: 20, temp: 0.0)

    [before | _] = String.split(full, "\n\n")
    {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "The capital of France is")

    assert {:ok, %{text: ^before, finish_reason: :stop}} =
             Server.complete_tokens(s, ids, max_tokens: 20, stop: ["\n\n"])

    assert Enum.join(Server.stream(s, "The capital of France is", max_tokens: 20, stop: ["\n\n"])) ==
             before

    assert {:error, "invalid stop: 5"} = Server.generate(s, "x", stop: 5)
    GenServer.stop(s)
  end
end
