defmodule LlamaCppEx.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    LlamaCppEx.Limits.apply_config()

    children = [
      {Registry, keys: :unique, name: LlamaCppEx.Registry},
      LlamaCppEx.Chat.Renderer,
      # the `:pg` scope of `LlamaCppEx.Cluster`'s groups, and this node's copy of their loads
      %{id: :pg, start: {:pg, :start_link, [LlamaCppEx.Cluster.scope()]}},
      LlamaCppEx.Cluster.Directory
    ]

    Supervisor.start_link(children, strategy: :one_for_one, name: LlamaCppEx.Supervisor)
  end
end
