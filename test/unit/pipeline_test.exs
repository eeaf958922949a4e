defmodule LlamaCppEx.PipelineTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.{Pipeline, UTF8Stream}

  defp pipeline(stop \\ nil, max \\ nil, logprobs \\ false),
    do: Pipeline.new(%{stop: stop, logprobs: logprobs}, max)

  # every piece pushed in order: all events, and whether the last push ended the request
  defp run(p, pieces) do
    Enum.reduce_while(pieces, {[], p}, fn {piece, eog}, {events, p} ->
      case Pipeline.push(p, piece, eog, nil) do
        {:cont, more, p} -> {:cont, {events ++ more, p}}
        {:done, more, p} -> {:halt, {events ++ more, p}}
      end
    end)
  end

  defp text(events), do: for({:token, t} <- events, into: "", do: t)

  describe "UTF8Stream" do
    test "holds back an incomplete trailing sequence and completes it later" do
      <<a, b, c>> = "€"
      assert {"x", <<^a, ^b>>} = UTF8Stream.push("", <<?x, a, b>>)
      assert {"€y", ""} = UTF8Stream.push(<<a, b>>, <<c, ?y>>)
    end

    test "every split of multi-byte text re-assembles exactly" do
      text = "aé€😀z"

      for cut <- 0..byte_size(text) do
        <<first::binary-size(cut), rest::binary>> = text
        {out1, held} = UTF8Stream.push("", first)
        {out2, ""} = UTF8Stream.push(held, rest)
        assert out1 <> out2 == text
        assert String.valid?(out1)
      end
    end

    test "invalid bytes pass straight through" do
      assert {<<0xFF, ?a>>, ""} = UTF8Stream.push("", <<0xFF, ?a>>)
    end
  end

  test "text passes through, end of generation ends with :eog" do
    {events, p} = run(pipeline(), [{"Hel", false}, {"lo", false}, {"", true}])
    assert text(events) == "Hello"
    assert List.last(events) == {:done, :eog}
    assert p.generated == 3
  end

  test "max_tokens ends the request after that many tokens" do
    {events, _} = run(pipeline(nil, 2), [{"a", false}, {"b", false}, {"c", false}])
    assert text(events) == "ab"
    assert List.last(events) == {:done, :max_tokens}
  end

  test "a stop string split across tokens is matched and never emitted" do
    {events, _} = run(pipeline(["STOP"]), [{"one S", false}, {"TO", false}, {"P two", false}])

    assert text(events) == "one "
    assert List.last(events) == {:done, :stop}
  end

  test "text held for a possible stop string is released at the end" do
    {events, _} = run(pipeline("STOP", 2), [{"a", false}, {"ST", false}])
    assert text(events) == "aST"
    assert List.last(events) == {:done, :max_tokens}
  end

  test "a piece ending inside a character waits for the rest" do
    <<a, b, c>> = "€"
    p = pipeline()
    {:cont, events, p} = Pipeline.push(p, <<?x, a>>, false, nil)
    assert text(events) == "x"
    {:cont, events, _} = Pipeline.push(p, <<b, c>>, false, nil)
    assert text(events) == "€"
  end

  test "log-probabilities are reported only when asked for" do
    lp = {-0.5, []}
    {:cont, events, _} = Pipeline.push(pipeline(nil, nil, true), "a", false, lp)
    assert [{:logprob, {"a", ^lp}}, {:token, "a"}] = events
    {:cont, events, _} = Pipeline.push(pipeline(), "a", false, lp)
    assert [{:token, "a"}] = events
  end

  test "a failure releases held text first" do
    {:cont, [], p} = Pipeline.push(pipeline("STOP"), "ST", false, nil)
    assert [{:token, "ST"}, {:error, :boom}] = Pipeline.fail(p, :boom)
  end
end
