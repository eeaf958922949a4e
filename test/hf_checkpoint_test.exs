defmodule LlamaCppEx.HfCheckpointTest do
  @moduledoc """
  Hugging Face checkpoint directories through the Elixir API (`test/fixtures/hf`, the tiny
  GGUF models written back in Hugging Face layout by `scripts/hf_fixtures.py`; the engine's
  `tests/hf_checkpoint.rs` compares their logits with the GGUF files').
  """
  use ExUnit.Case, async: true

  alias LlamaCppEx.{Model, Server}

  @hf Path.expand("fixtures/hf", __DIR__)
  @tiny Path.expand("fixtures/tiny", __DIR__)

  for arch <- ~w(llama qwen2 qwen3 gemma3) do
    test "#{arch}: the safetensors checkpoint generates what its GGUF generates" do
      arch = unquote(arch)
      {:ok, gguf} = LlamaCppEx.load_model(Path.join(@tiny, "tiny-#{arch}-f32.gguf"))
      {:ok, hf} = LlamaCppEx.load_model(Path.join(@hf, arch), quantize: :none)

      for prompt <- ["hello there", "<|im_start|>user\nhi<|im_end|>"] do
        assert LlamaCppEx.generate(hf, prompt, max_tokens: 12, temp: 0.0) ==
                 LlamaCppEx.generate(gguf, prompt, max_tokens: 12, temp: 0.0)
      end

      messages = [%{role: "user", content: "hello"}]

      assert LlamaCppEx.Chat.apply_template(hf, messages) ==
               LlamaCppEx.Chat.apply_template(gguf, messages)

      assert Model.desc(hf) =~ Model.architecture(gguf)
    end
  end

  test "a checkpoint directory serves through the Server, quantized at load" do
    dir = Path.join(@hf, "qwen2")
    {:ok, direct_model} = LlamaCppEx.load_model(dir)
    assert Model.desc(direct_model) =~ "Q8_0"
    {:ok, direct} = LlamaCppEx.generate(direct_model, "hello there", max_tokens: 8, temp: 0.0)

    {:ok, server} = Server.start_link(model_path: dir, n_parallel: 2, n_ctx: 256, temp: 0.0)
    assert {:ok, ^direct} = Server.generate(server, "hello there", max_tokens: 8)
    GenServer.stop(server)
  end

  test "quantize types, vocab-only loads and bad options" do
    dir = Path.join(@hf, "llama-f16-256")

    sizes =
      for q <- [:none, :q8_0, :q4_k, :q4_0] do
        {:ok, m} = LlamaCppEx.load_model(dir, quantize: q)
        Model.size(m)
      end

    assert sizes == Enum.sort(sizes, :desc)

    {:ok, vocab} = LlamaCppEx.load_model(dir, vocab_only: true)
    assert {:ok, [_ | _]} = LlamaCppEx.Tokenizer.encode(vocab, "hello")

    assert {:error, msg} = LlamaCppEx.load_model(dir, quantize: :q3_k)
    assert msg =~ "quantize"
  end

  test "broken and unsupported checkpoints are errors naming the problem" do
    missing = Path.join(System.tmp_dir!(), "llama_cpp_ex_no_such_checkpoint")
    assert {:error, _} = LlamaCppEx.load_model(missing)

    dir =
      Path.join(System.tmp_dir!(), "llama_cpp_ex_hf_test_#{System.unique_integer([:positive])}")

    File.mkdir_p!(dir)
    File.write!(Path.join(dir, "config.json"), ~s({"model_type": "llama"}))
    assert {:error, msg} = LlamaCppEx.load_model(dir)
    assert msg =~ "no model.safetensors"
    File.rm_rf!(dir)

    dir =
      Path.join(System.tmp_dir!(), "llama_cpp_ex_hf_type_#{System.unique_integer([:positive])}")

    File.mkdir_p!(dir)
    File.cp_r!(Path.join(@hf, "qwen2"), dir)
    File.write!(Path.join(dir, "config.json"), ~s({"model_type": "mamba"}))
    assert {:error, msg} = LlamaCppEx.load_model(dir)
    assert msg =~ "unsupported model architecture: mamba"
    File.rm_rf!(dir)
  end
end
