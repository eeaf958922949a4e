defmodule LlamaCppEx.ChatTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{
    Chat,
    ChatCompletion,
    ChatCompletionChunk,
    Server,
    TestModels,
    Thinking,
    Tokenizer
  }

  @fixtures Path.expand("fixtures", __DIR__)

  setup_all do
    %{model: TestModels.smollm2()}
  end

  test "SmolLM2's template renders the fixture's chat prompts id for id", %{model: model} do
    # chat_capital in greedy_SmolLM2-135M-Instruct.Q4_1.json (rendered by llama-server)
    fixture = File.read!(Path.join(@fixtures, "greedy_SmolLM2-135M-Instruct.Q4_1.json"))

    [_, ids_text] =
      Regex.run(~r/"name": "chat_capital".*?"prompt_ids": \[([0-9,\s]+)\]/s, fixture)

    expected =
      ids_text |> String.split(",") |> Enum.map(&(&1 |> String.trim() |> String.to_integer()))

    {:ok, prompt} =
      Chat.apply_template(model, [%{role: "user", content: "What is the capital of France?"}])

    assert {:ok, ^expected} = Tokenizer.encode(model, prompt)
  end

  test "message shapes, options and errors", %{model: model} do
    msgs = [
      %{role: "system", content: "Be brief."},
      %{"role" => "user", "content" => "Hi"},
      {:assistant, "Hello"}
    ]

    assert {:ok, prompt} = Chat.apply_template(model, msgs)

    assert prompt ==
             "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" <>
               "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n"

    assert {:ok, no_gen} = Chat.apply_template(model, msgs, add_assistant: false)
    refute String.ends_with?(no_gen, "<|im_start|>assistant\n")
    assert {:error, "chat template failed: " <> _} = Chat.apply_template(model, [:bad])

    assert_raise ArgumentError, ~r/unknown option: :template/, fn ->
      Chat.apply_template(model, msgs, template: "x")
    end
  end

  test "chat and chat_completion on a model", %{model: model} do
    msgs = [%{role: "user", content: "Name the capital of France."}]
    assert {:ok, text} = LlamaCppEx.chat(model, msgs, max_tokens: 16, temp: 0.0)
    assert text =~ "Paris"

    assert {:ok, %ChatCompletion{} = c} =
             LlamaCppEx.chat_completion(model, msgs, max_tokens: 16, temp: 0.0)

    assert "chatcmpl-" <> hex = c.id
    assert byte_size(hex) == 24
    assert c.object == "chat.completion"

    assert [
             %{
               index: 0,
               message: %{role: "assistant", content: ^text, reasoning_content: nil},
               finish_reason: "stop"
             }
           ] = c.choices

    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens

    assert {:ok, %{choices: [%{finish_reason: "length"}], usage: %{completion_tokens: 3}}} =
             LlamaCppEx.chat_completion(model, msgs, max_tokens: 3, temp: 0.0)

    assert {:error, :timeout} = LlamaCppEx.chat_completion(model, msgs, max_tokens: 3, timeout: 0)

    chunks =
      model
      |> LlamaCppEx.stream_chat_completion(msgs, max_tokens: 16, temp: 0.0)
      |> Enum.to_list()

    assert [
             %ChatCompletionChunk{
               choices: [%{delta: %{role: "assistant", content: ""}, finish_reason: nil}]
             } = first
             | rest
           ] = chunks

    assert %{choices: [%{delta: %{}, finish_reason: "stop"}]} = List.last(rest)
    assert Enum.all?(chunks, &(&1.id == first.id and &1.object == "chat.completion.chunk"))

    assert rest |> Enum.flat_map(& &1.choices) |> Enum.map_join(&Map.get(&1.delta, :content, "")) ==
             text
  end

  test "chat completion through a server" do
    {:ok, s} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 2,
        n_ctx: 2048,
        temp: 0.0
      )

    msgs = [%{role: "user", content: "Name the capital of France."}]

    {:ok, local} =
      LlamaCppEx.chat_completion(TestModels.smollm2(), msgs, max_tokens: 16, temp: 0.0)

    assert {:ok, %ChatCompletion{choices: [choice]}} =
             LlamaCppEx.chat_completion(s, msgs, max_tokens: 16)

    assert choice == hd(local.choices)

    chunks = s |> LlamaCppEx.stream_chat_completion(msgs, max_tokens: 16) |> Enum.to_list()
    assert List.last(chunks).choices |> hd() |> Map.get(:finish_reason) == "stop"

    assert chunks
           |> Enum.flat_map(& &1.choices)
           |> Enum.map_join(&Map.get(&1.delta, :content, "")) == choice.message.content

    assert_raise ArgumentError, ~r/unknown option: :n_ctx/, fn ->
      LlamaCppEx.chat_completion(s, msgs, n_ctx: 10)
    end

    GenServer.stop(s)
  end

  test "thinking parser" do
    assert Thinking.parse("<think> a </think> b") == {" a", "b"}
    assert Thinking.parse("<think>open") == {"open", ""}
    assert Thinking.parse("pre</think>post") == {"pre", "post"}
    assert Thinking.parse("plain") == {"", "plain"}

    p = Thinking.stream_parser()
    {[], p} = Thinking.feed(p, "<thi")
    {[thinking: "abc"], p} = Thinking.feed(p, "nk>abc</th")
    {[content: " done"], _} = Thinking.feed(p, "ink> done")

    p = Thinking.stream_parser(thinking: true)
    {[thinking: "x"], p} = Thinking.feed(p, "x</")
    {[content: "y"], %{state: :content}} = Thinking.feed(p, "think>y")
    {[content: "hello"], %{state: :content}} = Thinking.feed(Thinking.stream_parser(), "hello")
  end
end
