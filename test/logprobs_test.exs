defmodule LlamaCppEx.LogprobsTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Context, Sampler, Server, TestModels, Tokenizer}

  @fixtures Path.expand("fixtures", __DIR__)

  test "chat completion logprobs in OpenAI's shape, close to llama.cpp's" do
    {:ok, model} = LlamaCppEx.load_model(TestModels.smollm2_path(), requantize: false)
    msgs = [%{role: "user", content: "Explain what a hash table is in two sentences."}]

    {:ok, c} =
      LlamaCppEx.chat_completion(model, msgs,
        max_tokens: 8,
        temp: 0.0,
        logprobs: true,
        top_logprobs: 3
      )

    [%{logprobs: %{content: entries}, message: %{content: content}}] = c.choices

    assert length(entries) ==
             c.usage.completion_tokens - if(hd(c.choices).finish_reason == "stop", do: 0, else: 0)

    assert Enum.map_join(entries, & &1.token) == content

    for e <- entries do
      assert e.logprob <= 0.0
      assert [first, _, _] = e.top_logprobs
      # greedy: the chosen token is the most likely one
      assert_in_delta e.logprob, first.logprob, 1.0e-6
      assert e.bytes == :binary.bin_to_list(e.token)
    end

    # llama.cpp's log-probabilities for the same steps (chat_hashtable), within its own
    # batching tolerance
    fixture = File.read!(Path.join(@fixtures, "greedy_SmolLM2-135M-Instruct.Q4_1.json"))
    [_, steps] = Regex.run(~r/"name": "chat_hashtable".*?"steps": \[(.*?)\n   \]/s, fixture)

    theirs =
      ~r/\n     "token": "((?:[^"\\]|\\.)*)",.*?\n     "logprob": (-?[0-9.e-]+)/s
      |> Regex.scan(steps)
      |> Enum.map(fn [_, token, lp] -> {token, String.to_float(lp)} end)

    # compare while both runs chose the same tokens (a near-tie may diverge later)
    compared =
      entries
      |> Enum.zip(theirs)
      |> Enum.take_while(fn {e, {token, _}} -> e.token == token end)

    assert length(compared) >= 3

    for {e, {_, expected}} <- compared do
      assert_in_delta e.logprob, expected, 0.5
    end

    # no logprobs key unless asked
    {:ok, plain} = LlamaCppEx.chat_completion(model, msgs, max_tokens: 2, temp: 0.0)
    refute Map.has_key?(hd(plain.choices), :logprobs)
    assert {:error, _} = Sampler.create(model, top_logprobs: 50)
  end

  test "raw top log-probabilities from a context" do
    model = TestModels.smollm2()
    {:ok, ctx} = Context.create(model, n_ctx: 128)
    {:ok, ids} = Tokenizer.encode(model, "The capital of France is")
    :ok = Context.decode(ctx, ids)
    {:ok, [{id, lp} | rest]} = Context.top_logprobs(ctx, 5)
    assert Tokenizer.token_to_piece(model, id) == " Paris"
    assert lp < 0 and length(rest) == 4
    assert Enum.all?(rest, fn {_, l} -> l <= lp end)
    {:ok, logits} = Context.logits(ctx)
    assert length(logits) == Tokenizer.vocab_size(model)
  end

  test "logprobs through the server match the local route" do
    model = TestModels.smollm2()

    {:ok, s} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 2,
        n_ctx: 1024,
        temp: 0.0
      )

    msgs = [%{role: "user", content: "Name a color."}]

    {:ok, local} =
      LlamaCppEx.chat_completion(model, msgs,
        max_tokens: 6,
        temp: 0.0,
        logprobs: true,
        top_logprobs: 2
      )

    {:ok, remote} =
      LlamaCppEx.chat_completion(s, msgs, max_tokens: 6, logprobs: true, top_logprobs: 2)

    assert hd(remote.choices).logprobs == hd(local.choices).logprobs

    # streamed: each content chunk carries the log-probabilities of its tokens
    for target <- [model, s] do
      chunks =
        target
        |> LlamaCppEx.stream_chat_completion(msgs,
          max_tokens: 6,
          temp: 0.0,
          logprobs: true,
          top_logprobs: 2
        )
        |> Enum.to_list()

      streamed =
        Enum.flat_map(chunks, fn c -> get_in(hd(c.choices), [:logprobs, :content]) || [] end)

      assert streamed == hd(local.choices).logprobs.content
    end

    GenServer.stop(s)
  end
end
