defmodule LlamaCppEx.ChatCompletion do
  @moduledoc """
  An OpenAI-shaped chat completion, as returned by `LlamaCppEx.chat_completion/3`:
  `choices: [%{index: 0, message: %{role: "assistant", content: text, reasoning_content: nil | text},
  finish_reason: "stop" | "length"}]` and `usage: %{prompt_tokens, completion_tokens, total_tokens}`.
  """
  defstruct [:id, :object, :created, :model, :choices, :usage]

  @type t :: %__MODULE__{
          id: String.t() | nil,
          object: String.t() | nil,
          created: integer() | nil,
          model: String.t() | nil,
          choices: [map()] | nil,
          usage:
            %{
              prompt_tokens: non_neg_integer(),
              completion_tokens: non_neg_integer(),
              total_tokens: non_neg_integer()
            }
            | nil
        }
end

defmodule LlamaCppEx.ChatCompletionChunk do
  @moduledoc """
  One element of `LlamaCppEx.stream_chat_completion/3`: `choices: [%{index: 0, delta: map,
  finish_reason: nil | "stop" | "length" | "tool_calls"}]`, and `usage` on the last chunk of a
  stream asked for it (`include_usage: true`).
  """
  defstruct [:id, :object, :created, :model, :choices, :usage]

  @type t :: %__MODULE__{
          id: String.t() | nil,
          object: String.t() | nil,
          created: integer() | nil,
          model: String.t() | nil,
          choices: [map()] | nil,
          usage: map() | nil
        }
end
