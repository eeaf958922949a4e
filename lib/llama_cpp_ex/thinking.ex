defmodule LlamaCppEx.Thinking do
  @moduledoc """
  Splits `<think>...</think>` reasoning from answer text, whole or while streaming.

      iex> LlamaCppEx.Thinking.parse("<think>hmm</think> Paris")
      {"hmm", "Paris"}

      iex> LlamaCppEx.Thinking.parse("no tags")
      {"", "no tags"}
  """

  @open "<think>"
  @close "</think>"

  @type event :: {:thinking, String.t()} | {:content, String.t()}
  @type parser :: %{state: :init | :thinking | :content, buffer: String.t()}

  @doc """
  Returns `{reasoning, content}`. Text starting with `<think>` is reasoning up to the first
  `</think>` (all of it when unclosed); otherwise text before a `</think>` anywhere is
  reasoning (templates that open the block in the prompt).
  """
  @spec parse(String.t()) :: {String.t(), String.t()}
  def parse(@open <> rest) do
    case :binary.split(rest, @close) do
      [reasoning, content] -> {String.trim_trailing(reasoning), String.trim_leading(content)}
      [reasoning] -> {String.trim_trailing(reasoning), ""}
    end
  end

  def parse(text) do
    case :binary.split(text, @close) do
      [reasoning, content] -> {String.trim_trailing(reasoning), String.trim_leading(content)}
      [_] -> {"", text}
    end
  end

  @doc "A streaming parser; `thinking: true` starts inside a reasoning block."
  @spec stream_parser(keyword()) :: parser()
  def stream_parser(opts \\ []) do
    %{state: if(Keyword.get(opts, :thinking, false), do: :thinking, else: :init), buffer: ""}
  end

  @doc "Feeds a chunk; returns the events it completes and the new parser."
  @spec feed(parser(), String.t()) :: {[event()], parser()}
  def feed(%{state: :content} = p, chunk), do: {nonempty(:content, chunk), p}

  def feed(%{state: :init, buffer: buf} = p, chunk) do
    data = buf <> chunk

    cond do
      String.starts_with?(data, @open) ->
        feed(%{p | state: :thinking, buffer: ""}, binary_part(data, 7, byte_size(data) - 7))

      String.starts_with?(@open, data) ->
        {[], %{p | buffer: data}}

      true ->
        {nonempty(:content, data), %{p | state: :content, buffer: ""}}
    end
  end

  def feed(%{state: :thinking, buffer: buf} = p, chunk) do
    data = buf <> chunk

    case :binary.split(data, @close) do
      [thinking, rest] ->
        {nonempty(:thinking, thinking) ++ nonempty(:content, rest),
         %{p | state: :content, buffer: ""}}

      [_] ->
        keep = LlamaCppEx.StopMatcher.longest_partial(data, [@close])
        emit = binary_part(data, 0, byte_size(data) - keep)

        {nonempty(:thinking, emit),
         %{p | buffer: binary_part(data, byte_size(data) - keep, keep)}}
    end
  end

  defp nonempty(_kind, ""), do: []
  defp nonempty(kind, text), do: [{kind, text}]
end
