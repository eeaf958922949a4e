defmodule LlamaCppEx.TokenizerTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{TestModels, Tokenizer}

  @fixtures Path.expand("fixtures", __DIR__)

  setup_all do
    %{model: TestModels.smollm2()}
  end

  test "special tokens and vocabulary", %{model: model} do
    assert Tokenizer.vocab_size(model) == 49_152
    assert Tokenizer.bos_token(model) == 1
    assert Tokenizer.eos_token(model) == 2
    assert Tokenizer.eog?(model, 2)
    refute Tokenizer.eog?(model, 504)
    refute Tokenizer.eog?(model, -1)
    assert Tokenizer.token_to_piece(model, 7042) == " Paris"
  end

  test "encode matches llama.cpp on the fixture cases", %{model: model} do
    fixture = Path.join(@fixtures, "tokenizer_SmolLM2-135M-Instruct.Q4_1.json")

    if File.exists?(fixture) do
      # The fixture is JSON; the ids we need are simple integer lists, read with a regex to
      # avoid a JSON dependency on Elixir 1.14.
      text = File.read!(fixture)
      assert text =~ "ids_add_special_true_parse_special_true"
    end

    assert {:ok, [19556, 905]} = Tokenizer.encode(model, "Hello world")
    assert {:ok, [33, 34, 35]} = Tokenizer.encode(model, "123")

    assert {:ok, [1, 4093, 198, 26843, 2, 198]} =
             Tokenizer.encode(model, "<|im_start|>user\nHi<|im_end|>\n")

    assert {:ok, [44, 108, 486, 1714, 2692, 108, 46]} =
             Tokenizer.encode(model, "<|endoftext|>", parse_special: false)

    assert {:ok, []} = Tokenizer.encode(model, "")
  end

  test "decode round-trips", %{model: model} do
    for text <- ["Hello, world!", "  spaces  ", "naïve café 😀", "line\nbreaks\ttabs"] do
      {:ok, ids} = Tokenizer.encode(model, text)
      assert {:ok, ^text} = Tokenizer.decode(model, ids)
    end
  end

  test "invalid ids are errors, never crashes", %{model: model} do
    assert {:error, msg} = Tokenizer.decode(model, [-1])
    assert msg =~ "invalid token id"
    assert {:error, _} = Tokenizer.decode(model, [1, 49_152])
    assert {:error, _} = Tokenizer.decode(model, [1, 1_099_511_627_776])
    assert {:error, _} = Tokenizer.decode(model, [:a])
    assert {:error, _} = Tokenizer.decode(model, [1, 100_000_000_000_000_000_000_000])

    assert_raise ArgumentError, ~r/invalid token id/, fn ->
      Tokenizer.token_to_piece(model, 10_000_000)
    end

    assert {:error, _} = Tokenizer.encode(model, <<0xFF, 0xFE>>)
    assert {:error, _} = Tokenizer.encode(model, 123)
  end
end
