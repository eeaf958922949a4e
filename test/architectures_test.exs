defmodule LlamaCppEx.ArchitecturesTest do
  @moduledoc """
  Every architecture the engine implements, through the Elixir API and the Server, on the
  tiny random-weight models of `test/fixtures/tiny` (their numerical parity with llama.cpp is
  checked by the engine's `tests/arch_parity.rs`): the model route and the Server produce the
  same greedy tokens, with no per-architecture path.
  """
  use ExUnit.Case, async: true

  alias LlamaCppEx.{Model, Server}

  @tiny Path.expand("fixtures/tiny", __DIR__)
  @archs ~w(llama llama3 qwen2 qwen3 phi3 gemma2 gemma3)

  for arch <- @archs do
    test "#{arch}: generate on the model and through a Server agree" do
      path = Path.join(@tiny, "tiny-#{unquote(arch)}-f32.gguf")
      {:ok, model} = LlamaCppEx.load_model(path)
      assert Model.desc(model) =~ String.replace(unquote(arch), "llama3", "llama")

      {:ok, direct} = LlamaCppEx.generate(model, "hello there", max_tokens: 12, temp: 0.0)

      {:ok, server} = Server.start_link(model_path: path, n_parallel: 2, n_ctx: 512, temp: 0.0)

      # two requests at once: the second rides in the same forward passes
      tasks =
        for prompt <- ["hello there", "the other"] do
          Task.async(fn -> Server.generate(server, prompt, max_tokens: 12) end)
        end

      [{:ok, served}, {:ok, _other}] = Task.await_many(tasks, 60_000)
      assert served == direct
      GenServer.stop(server)
    end
  end

  test "files with features the engine does not implement are named errors" do
    assert {:error, msg} = LlamaCppEx.load_model(Path.join(@tiny, "refuse-yarn.gguf"))
    assert msg =~ "unsupported rope scaling: yarn"

    assert {:error, msg} = LlamaCppEx.load_model(Path.join(@tiny, "refuse-extra-tensor.gguf"))
    assert msg =~ "unsupported tensor: blk.0.ffn_gate.bias"
  end

  test "IQ4 weights load (converted to Q8_0) and generate" do
    for q <- ~w(iq4_nl iq4_xs) do
      {:ok, model} = LlamaCppEx.load_model(Path.join(@tiny, "quant-#{q}.gguf"))
      assert {:ok, text} = LlamaCppEx.generate(model, "hello", max_tokens: 4, temp: 0.0)
      assert is_binary(text)
    end
  end
end
