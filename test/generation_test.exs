defmodule LlamaCppEx.GenerationTest do
  # One answer per condition, whichever route a request takes (the table in
  # `LlamaCppEx.Generation`'s documentation).
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Context, Sampler, Server, TestModels}

  setup_all do
    model = TestModels.smollm2()
    {:ok, server} = Server.start_link(model_path: TestModels.smollm2_path(), n_ctx: 64, temp: 0.0)
    {:ok, _} = TestModels.wait_model(server)
    {:ok, model: model, server: server}
  end

  defp routes(model, server) do
    [
      model: &LlamaCppEx.generate(model, &1, &2),
      model_stream: &single(LlamaCppEx.stream(model, &1, &2)),
      server: &Server.generate(server, &1, &2),
      server_stream: &single(Server.stream(server, &1, &2)),
      server_tokens: fn prompt, opts ->
        with {:ok, ids} <- LlamaCppEx.Tokenizer.encode(model, prompt),
             do: Server.complete_tokens(server, ids, opts)
      end
    ]
  end

  # a stream that fails at once is the error alone
  defp single(stream) do
    case Enum.to_list(stream) do
      [{:error, reason}] -> {:error, reason}
      chunks -> {:ok, Enum.join(chunks)}
    end
  end

  test "bad values answer the same on every route", %{model: model, server: server} do
    for {route, run} <- routes(model, server) do
      assert {:error, "invalid max_tokens: 0"} = run.("Hi", max_tokens: 0), "#{route}"
      assert {:error, "invalid stop: 5"} = run.("Hi", stop: 5), "#{route}"
      assert {:error, "invalid top_logprobs: 21"} = run.("Hi", top_logprobs: 21), "#{route}"
      assert {:error, :invalid_grammar} = run.("Hi", grammar: "root ::= nope"), "#{route}"
    end
  end

  test "empty prompts and unknown token ids", %{model: model, server: server} do
    assert {:error, :empty_prompt} = LlamaCppEx.generate(model, "")
    assert {:error, :empty_prompt} = Server.generate(server, "")
    assert {:error, :empty_prompt} = Server.generate_tokens(server, [])
    assert [{:error, :empty_prompt}] = Enum.to_list(Server.stream_tokens(server, []))

    assert {:error, :invalid_token} = Server.generate_tokens(server, [1, 10_000_000])
    assert {:error, :invalid_token} = Server.generate_tokens(server, [-1])

    {:ok, ctx} = Context.create(model, n_ctx: 64)
    {:ok, sampler} = Sampler.create(model, temp: 0.0)
    assert {:error, :empty_prompt} = Context.generate(ctx, sampler, [])
    assert {:error, :invalid_token} = Context.generate(ctx, sampler, [10_000_000])
  end

  test "a prompt the context cannot hold", %{model: model, server: server} do
    long = String.duplicate("word ", 100)
    assert {:error, :context_full} = LlamaCppEx.generate(model, long, n_ctx: 16)
    assert {:error, :context_full} = Server.generate(server, long)
    assert [{:error, :context_full}] = Enum.to_list(Server.stream(server, long))
  end

  test "the limits come from the engine" do
    limits = LlamaCppEx.Limits.engine()
    assert limits.max_context_tokens == 4_194_304
    assert limits.max_top_logprobs == 20
    assert limits.default_context_tokens == 2048
    assert limits.max_threads >= 2
  end
end
