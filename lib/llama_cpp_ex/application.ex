defmodule LlamaCppEx.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    LlamaCppEx.Limits.apply_config()

    children = [
      {Registry, keys: :unique, name: LlamaCppEx.Registry},
      LlamaCppEx.Chat.Renderer
    ]

    Supervisor.start_link(children, strategy: :one_for_one, name: LlamaCppEx.Supervisor)
  end
end
