defmodule LlamaCppEx.BadInputTest do
  @moduledoc """
  Hostile and mistaken input must give `{:error, _}` or an `ArgumentError`, never take the VM
  down. Each test ends by checking that the VM still answers and the shared model still works.
  """
  use ExUnit.Case, async: false

  import Bitwise
  alias LlamaCppEx.{Context, Model, Sampler, TestModels}

  @moduletag :tmp_dir

  setup_all do
    %{model: TestModels.smollm2()}
  end

  defp still_healthy(model) do
    assert {:ok, text} = LlamaCppEx.generate(model, "Hi", max_tokens: 2, temp: 0.0)
    assert is_binary(text)
  end

  test "missing file, directory, empty file, random bytes", %{model: model, tmp_dir: dir} do
    assert {:error, msg} = LlamaCppEx.load_model(Path.join(dir, "nope.gguf"))
    assert msg =~ "failed to load model from"
    assert {:error, _} = LlamaCppEx.load_model(dir)

    empty = Path.join(dir, "empty.gguf")
    File.write!(empty, "")
    assert {:error, _} = LlamaCppEx.load_model(empty)

    random = Path.join(dir, "random.gguf")
    File.write!(random, :crypto.strong_rand_bytes(100_000))
    assert {:error, _} = LlamaCppEx.load_model(random)

    magic = Path.join(dir, "magic.gguf")
    File.write!(magic, "GGUF" <> :crypto.strong_rand_bytes(100_000))
    assert {:error, _} = LlamaCppEx.load_model(magic)

    assert {:error, _} = LlamaCppEx.load_model(:not_a_path)
    still_healthy(model)
  end

  test "a real GGUF truncated at many offsets", %{model: model, tmp_dir: dir} do
    src = TestModels.smollm2_path()
    size = File.stat!(src).size
    {:ok, fd} = :file.open(src, [:read, :binary, :raw])

    offsets =
      [4, 8, 16, 24, 100, 1_000, 10_000, 100_000, 1_000_000, 1_500_000, 5_000_000] ++
        Enum.map(1..6, &div(size * &1, 7)) ++ [size - 1]

    for offset <- offsets do
      {:ok, data} = :file.pread(fd, 0, offset)
      path = Path.join(dir, "trunc_#{offset}.gguf")
      File.write!(path, data)
      assert {:error, msg} = LlamaCppEx.load_model(path), "offset #{offset} loaded"
      assert is_binary(msg)
      File.rm!(path)
    end

    :file.close(fd)
    still_healthy(model)
  end

  test "hostile lengths in the header", %{model: model, tmp_dir: dir} do
    # version 3, 1 tensor, 1 metadata entry whose key claims 2^62 bytes
    header = "GGUF" <> <<3::little-32, 1::little-64, 1::little-64, 1 <<< 62::little-64>>
    path = Path.join(dir, "hostile.gguf")
    File.write!(path, header <> :binary.copy(<<0>>, 64))
    assert {:error, msg} = LlamaCppEx.load_model(path)
    assert msg =~ "exceeds"

    # huge tensor count
    File.write!(path, "GGUF" <> <<3::little-32, 1 <<< 60::little-64, 0::little-64>>)
    assert {:error, _} = LlamaCppEx.load_model(path)
    still_healthy(model)
  end

  test "an unsupported architecture", %{model: model, tmp_dir: dir} do
    data = File.read!(TestModels.smollm2_path())
    key = "general.architecture"
    needle = key <> <<8::little-32, 5::little-64>> <> "llama"
    patched = :binary.replace(data, needle, key <> <<8::little-32, 5::little-64>> <> "mamba")
    refute patched == data
    path = Path.join(dir, "mamba.gguf")
    File.write!(path, patched)
    assert {:error, msg} = LlamaCppEx.load_model(path)
    assert msg =~ "unsupported model architecture: mamba"
    still_healthy(model)
  end

  test "out-of-range and negative token ids", %{model: model} do
    {:ok, ctx} = Context.create(model, n_ctx: 128)
    {:ok, sampler} = Sampler.create(model, temp: 0.0)
    assert {:error, :invalid_token} = Context.generate(ctx, sampler, [1, 49_152], max_tokens: 4)
    assert {:error, :invalid_token} = Context.generate(ctx, sampler, [-3], max_tokens: 4)
    assert {:error, _} = Context.decode(ctx, [99_999_999])
    assert {:error, _} = Context.decode(ctx, [])
    assert {:error, :empty_prompt} = Context.generate(ctx, sampler, [], max_tokens: 4)
    assert {:error, _} = Context.generate(ctx, sampler, [1], max_tokens: 0)
    assert {:error, _} = Context.generate(ctx, sampler, [1], max_tokens: -5)
    still_healthy(model)
  end

  test "n_ctx zero, negative or absurd, and bad sizes", %{model: model} do
    assert {:error, _} = Context.create(model, n_ctx: 0)
    assert {:error, _} = Context.create(model, n_ctx: -1)
    assert {:error, _} = Context.create(model, n_ctx: 1 <<< 40)
    assert {:error, _} = Context.create(model, n_ctx: 100_000_000)
    assert {:error, _} = Context.create(model, n_ctx: "big")
    assert {:error, _} = Context.create(model, n_seq_max: 0)
    assert {:error, _} = Context.create(model, n_batch: 0)
    assert {:error, _} = Context.create(model, n_threads: 0)
    assert {:error, _} = LlamaCppEx.generate(model, "Hi", n_ctx: 0)
    assert {:error, _} = LlamaCppEx.generate(model, "Hi", n_ctx: 1 <<< 50)
    assert {:error, _} = LlamaCppEx.generate(model, "Hi", max_tokens: 0)
    assert {:error, _} = LlamaCppEx.generate(model, "Hi", max_tokens: -1)
    assert {:error, _} = LlamaCppEx.generate(model, "Hi", max_tokens: 1 <<< 40)
    assert {:error, _} = LlamaCppEx.generate(model, :not_text)
    still_healthy(model)
  end

  test "context overflow is an error and the context stays usable", %{model: model} do
    {:ok, ctx} = Context.create(model, n_ctx: 16, n_batch: 64)
    tokens = Enum.to_list(100..160)
    assert {:error, msg} = Context.decode(ctx, tokens)
    assert msg =~ "context full"
    assert {:ok, %{used: [0]}} = Context.kv_usage(ctx)
    assert :ok = Context.decode(ctx, [1, 2, 3])
    assert {:ok, %{used: [1]}} = Context.kv_usage(ctx)
  end

  test "bad sampler options", %{model: model} do
    assert {:error, _} = Sampler.create(model, seed: -1)
    assert {:error, _} = Sampler.create(model, temp: "hot")
    assert {:error, _} = Sampler.create(model, top_k: 1.5)
    assert {:error, _} = Sampler.create(model, penalty_repeat: 0.0)
    assert_raise ArgumentError, ~r/split_mode/, fn -> Model.load("x", split_mode: :diagonal) end
    {:ok, ctx} = Context.create(model, n_ctx: 64)
    {:ok, sampler} = Sampler.create(model)
    assert_raise ArgumentError, fn -> Sampler.sample(sampler, ctx) end
    still_healthy(model)
  end
end
