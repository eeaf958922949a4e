defmodule LlamaCppEx.GemmaTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Chat, Model, Server, TestModels, Tokenizer}

  @moduletag timeout: 600_000

  setup_all do
    {:ok, model} = LlamaCppEx.load_model(TestModels.gemma3_path(), requantize: false)
    %{model: model}
  end

  test "model facts", %{model: model} do
    assert Model.architecture(model) == "gemma3"
    assert Model.desc(model) == "gemma3 270M Q4_K_M"
    assert Model.n_embd(model) == 640
    assert Model.chat_template(model) == nil
    assert Tokenizer.bos_token(model) == 2
    assert Tokenizer.eog?(model, 106)
  end

  test "greedy generation follows llama.cpp on the file's own weight types", %{model: model} do
    # raw_capital in test/fixtures/greedy_gemma-3-270m-q4_k_m.json
    {:ok, text} = LlamaCppEx.generate(model, "The capital of France is", max_tokens: 8, temp: 0.0)
    assert text == " the capital of the country of France."
  end

  test "the built-in Gemma chat format", %{model: model} do
    msgs = [
      %{role: "system", content: "You are a helpful assistant."},
      %{role: "user", content: "Write a haiku about the sea."}
    ]

    {:ok, prompt} = Chat.apply_template(model, msgs)

    assert prompt ==
             "<start_of_turn>user\nYou are a helpful assistant.\n\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n"

    assert {:ok, %LlamaCppEx.ChatCompletion{choices: [%{message: %{content: content}}]}} =
             LlamaCppEx.chat_completion(model, msgs, max_tokens: 12, temp: 0.0)

    assert is_binary(content) and content != ""
  end

  test "in the server, sliding-window layers keep only the blocks of their window" do
    {:ok, s} =
      Server.start_link(
        model_path: TestModels.gemma3_path(),
        n_parallel: 2,
        n_ctx: 4096,
        temp: 0.0
      )

    model = wait_model(s)

    text =
      String.duplicate(
        "The history of computing is longer than the history of computing hardware. ",
        90
      )

    {:ok, ids} = Tokenizer.encode(model, text)
    ids = Enum.take(ids, 800)

    {:ok, first} = Server.generate_tokens(s, ids, max_tokens: 8)
    {:ok, audit} = Server.kv_audit(s)
    [local, global] = audit.used
    [cached] = audit.cached_tokens |> Map.values() |> Enum.filter(&(&1 > 0))
    assert cached >= 800
    # the global group holds every cached position, the window group only the last 512 or so
    assert global == div(cached + 15, 16)
    assert local <= div(512, 16) + 2

    # the same prompt again reuses the cache (sliding-window blocks included) and agrees
    assert {:ok, ^first} = Server.generate_tokens(s, ids, max_tokens: 8)
    # a shorter prefix of the cached sequence can no longer be continued in the window
    # layers, so it is recomputed, with the same result as a fresh context
    short = Enum.take(ids, 300)
    {:ok, fresh} = LlamaCppEx.Context.create(model, n_ctx: 1024) |> elem(1) |> then(&{:ok, &1})
    {:ok, sampler} = LlamaCppEx.Sampler.create(model, temp: 0.0)
    {:ok, expected} = LlamaCppEx.Context.generate(fresh, sampler, short, max_tokens: 6)
    assert {:ok, ^expected} = Server.generate_tokens(s, short, max_tokens: 6)
    {:ok, _} = Server.kv_audit(s)
    GenServer.stop(s)
  end

  defp wait_model(s) do
    case Server.fetch_model(s) do
      {:ok, m} -> m
      _ -> Process.sleep(50) && wait_model(s)
    end
  end
end
